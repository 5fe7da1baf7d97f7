"""The batched sampler: greedy, temperature, top-k, top-p, repetition penalty, keyed random draws."""

from __future__ import annotations

import math

import torch

from tokenmill_service.contract.request import SamplingParams
from tokenmill_service.worker.engine.sampler import (
    apply_frequency_presence_penalties,
    apply_logit_bias,
    apply_repetition_penalty,
    keyed_uniform,
    nucleus,
    sample,
)
from tokenmill_service.worker.kernels import argmax_rows


def test_greedy_picks_the_argmax_and_reports_raw_logprobs() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]])
    out = sample(logits, [SamplingParams(), SamplingParams()], [0, 1], [[], []], [2, 0])
    assert out.token_ids == [1, 0]
    expected = torch.log_softmax(logits, -1)
    assert math.isclose(out.logprobs[0], expected[0, 1].item(), rel_tol=1e-6)
    assert [i for i, _ in out.top_logprobs[0]] == [1, 2]
    assert out.top_logprobs[1] == []


def test_greedy_takes_the_first_of_tied_best_tokens_whatever_the_batch() -> None:
    """Ties at the maximum (and rows of -inf, a NaN) go to the first such index, as argmax's, alone and in a
    batch of 64 rows of a 128,256-token vocabulary."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 40, (64, 128256), generator=gen).float()  # each row's maximum many times over
    logits[3] = float("-inf")
    logits[5, 7] = float("nan")
    params, seeds, seen, top = [SamplingParams()] * 64, list(range(64)), [[]] * 64, [0] * 64
    batch = sample(logits, params, seeds, seen, top).token_ids
    alone = [sample(logits[i : i + 1], params[:1], seeds[:1], seen[:1], top[:1]).token_ids[0] for i in range(64)]
    assert batch == alone == logits.argmax(dim=-1).tolist()
    assert batch[3] == 0 and batch[5] == 7


def test_the_greedy_choice_is_torchs_first_maximal_index_at_every_length() -> None:
    """The native argmax (sampling.cpp) against torch's max indices: every length's tail of 16 lanes, a row
    with its maximum in the tail, +inf twice, -0 beside +0, and a NaN after the maximum (torch's index)."""
    gen = torch.Generator().manual_seed(1)
    for n in (1, 7, 16, 17, 31, 100, 1000, 50001):
        rows = torch.randint(-20, 20, (6, n + 3), generator=gen).float()[:, :n]  # rows n + 3 floats apart
        rows[1, -1] = 99.0
        rows[2, 0] = rows[2, -1] = float("inf")
        rows[3] = 0.0
        rows[3, ::2] = -0.0
        rows[4, -1] = float("nan")
        rows[5] = float("-inf")
        assert argmax_rows(rows).tolist() == rows.max(dim=-1).indices.tolist(), n


def test_top_k_never_picks_outside_the_k_most_likely() -> None:
    torch.manual_seed(0)
    logits = torch.randn(1, 50)
    allowed = set(logits[0].topk(5).indices.tolist())
    params = SamplingParams(temperature=5.0, top_k=5)  # a flat distribution tempts every token
    picked = {sample(logits, [params], [seed], [[]], [0]).token_ids[0] for seed in range(500)}
    assert picked == allowed


def test_top_p_never_picks_outside_the_nucleus() -> None:
    probs = torch.tensor([0.5, 0.3, 0.1, 0.05, 0.05])
    logits = probs.log()[None, :]
    params = SamplingParams(temperature=1.0, top_p=0.75)  # nucleus: tokens 0 and 1 (0.5 + 0.3 >= 0.75)
    seen = {sample(logits, [params], [seed], [[]], [0]).token_ids[0] for seed in range(500)}
    assert seen == {0, 1}


def test_top_p_keeps_at_least_the_best_token() -> None:
    kept = nucleus(torch.tensor([10.0, 0.0, 0.0]), 0, 0.01)
    assert kept is not None and kept.tolist() == [0]


def _nucleus_by_sorting(row: torch.Tensor, top_k: int, top_p: float) -> set[int]:
    """The definition, by a full sort: the top k, then the shortest prefix whose mass reaches p."""
    order = row.argsort(descending=True)
    if 0 < top_k < len(row):
        order = order[:top_k]
    probs = row[order].double().softmax(-1) if top_k else row.double().softmax(-1)[order]
    if not 0 < top_p < 1:
        return set(order.tolist())
    kept, mass = [], 0.0
    for token, prob in zip(order.tolist(), probs.tolist()):
        if kept and mass >= top_p:
            break
        kept.append(token)
        mass += prob
    return set(kept)


def test_the_nucleus_is_the_sorted_definition_whatever_its_size() -> None:
    """Rows whose nucleus spans a few tokens or most of a large vocabulary (several rounds of candidates):
    the same set as a full sort gives (up to ties of mass exactly at p, which random rows do not make)."""
    gen = torch.Generator().manual_seed(0)
    for spread in (0.01, 1.0, 8.0):  # flat: thousands of tokens in the nucleus; peaked: a handful
        row = torch.randn(20_000, generator=gen) * spread
        for top_k, top_p in ((0, 0.5), (0, 0.9), (0, 0.999), (50, 0.8), (3_000, 0.95), (50, 1.0), (0, 1.0)):
            kept = nucleus(row, top_k, top_p)
            if top_k == 0 and top_p == 1.0:
                assert kept is None
                continue
            assert kept is not None
            assert set(kept.tolist()) == _nucleus_by_sorting(row, top_k, top_p), (spread, top_k, top_p)
            assert len(set(kept.tolist())) == len(kept)


def test_top_p_keeps_every_token_as_likely_as_the_last_it_needs() -> None:
    """Ties at the nucleus's edge: all of them or none, whatever order a sort would put them in."""
    logits = torch.tensor([2.0, 1.0, 1.0, 1.0, 0.0]).log()
    kept = nucleus(logits, 0, 0.6)  # masses 0.4, then three of 0.2: 0.4 + 0.2 reaches 0.6
    assert kept is not None and sorted(kept.tolist()) == [0, 1, 2, 3]


def test_top_k_of_the_whole_vocabulary_or_more_restricts_nothing() -> None:
    row = torch.randn(100)
    assert nucleus(row, 100, 1.0) is None and nucleus(row, 500, 0.0) is None


def test_temperature_sampling_frequencies_match_the_softmax() -> None:
    logits = torch.tensor([[1.0, 0.5, 0.0, -1.0]])
    temperature = 0.8
    expected = torch.softmax(logits[0] / temperature, -1)
    params = SamplingParams(temperature=temperature)
    draws = 20000
    counts = torch.zeros(4)
    history: list[int] = []
    for _ in range(draws):
        # One request's stream: each draw is keyed by the seed and the position it samples.
        token = sample(logits, [params], [1234], [history], [0]).token_ids[0]
        counts[token] += 1
        history.append(token)
    # Pearson chi-square with 3 degrees of freedom; 16.27 is the 0.1% critical value.
    chi2 = (((counts - draws * expected) ** 2) / (draws * expected)).sum().item()
    assert chi2 < 16.27, (counts / draws, expected)


def test_same_seed_same_tokens_whatever_the_batch() -> None:
    torch.manual_seed(0)
    logits = torch.randn(8, 100)
    logits[1] = logits[2] = logits[0]  # rows 0-2 alike; rows 0 and 1 share a seed, row 2 does not
    params = [SamplingParams(temperature=1.0, top_p=0.9)] * 8
    seeds = [42, 42, 7, 7, 1, 2, 3, 4]

    def draw_alone(row: int) -> list[int]:
        history: list[int] = []
        for _ in range(20):
            history.append(sample(logits[row : row + 1], params[:1], [seeds[row]], [history], [0]).token_ids[0])
        return history

    histories: list[list[int]] = [[] for _ in range(8)]
    for _ in range(20):
        step = sample(logits, params, seeds, histories, [0] * 8).token_ids
        for row, token in enumerate(step):
            histories[row].append(token)
    for row in range(8):
        assert histories[row] == draw_alone(row)
    assert histories[0] == histories[1] and histories[0] != histories[2]  # the seed decides, not the row


def test_keyed_draws_depend_on_seed_and_position_only() -> None:
    draws = [keyed_uniform(seed, pos) for seed in range(50) for pos in range(50)]
    assert all(0.0 <= u < 1.0 for u in draws)
    assert len(set(draws)) == len(draws)  # no collisions among 2,500 keys
    assert keyed_uniform(7, 3) == keyed_uniform(7, 3)
    mean = sum(draws) / len(draws)
    assert abs(mean - 0.5) < 0.02


def test_repetition_penalty_lowers_seen_tokens_both_signs() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0]])
    out = apply_repetition_penalty(logits.clone(), [[0, 1]], [2.0])
    assert out.tolist() == [[1.0, -4.0, 1.0]]
    unchanged = apply_repetition_penalty(logits.clone(), [[0, 1]], [1.0])
    assert torch.equal(unchanged, logits)


def test_greedy_with_repetition_penalty_avoids_the_repeat() -> None:
    logits = torch.tensor([[2.0, 1.9, 0.0]])
    params = SamplingParams(repetition_penalty=1.5)
    assert sample(logits, [params], [0], [[0]], [0]).token_ids == [1]


def test_sampling_leaves_the_callers_logits_as_they_were() -> None:
    """The penalty works on a copy (and only a penalized batch makes one): a speculative step
    reads the same logits again after sampling."""
    logits = torch.tensor([[0.0, 3.0, 1.0, -2.0], [2.0, 0.0, 1.0, 0.5]])
    before = logits.clone()
    params = [SamplingParams(repetition_penalty=4.0), SamplingParams(temperature=0.7, repetition_penalty=1.3)]
    penalized = sample(logits, params, [0, 1], [[1, 3], [0]], [1, 1])
    assert torch.equal(logits, before)
    plain = sample(logits, [SamplingParams(), SamplingParams(temperature=0.7)], [0, 1], [[1, 3], [0]], [1, 1])
    assert torch.equal(logits, before)
    assert penalized.token_ids[0] == 2 and plain.token_ids[0] == 1  # 3.0 / 4 < 1.0: the penalty took effect


def test_logit_bias_bans_and_forces_tokens_and_leaves_logprobs_alone() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    assert sample(logits, [SamplingParams(logit_bias={0: -100.0})], [0], [[]], [0]).token_ids == [1]
    forced = sample(logits, [SamplingParams(logit_bias={2: 100.0})], [0], [[]], [0])
    assert forced.token_ids == [2]
    assert math.isclose(forced.logprobs[0], torch.log_softmax(logits, -1)[0, 2].item(), rel_tol=1e-6)
    assert apply_logit_bias(logits.clone(), [{1: 0.5}]).tolist() == [[2.0, 1.5, 0.0]]


def test_frequency_and_presence_penalties_count_generated_tokens_only() -> None:
    logits = torch.tensor([[3.0, 3.0, 3.0, 3.0]])
    # Token 0 generated twice, token 1 once; token 3 only in the prompt.
    out = apply_frequency_presence_penalties(logits.clone(), [[0, 1, 0]], [0.5], [0.25])
    assert out.tolist() == [[3.0 - 2 * 0.5 - 0.25, 3.0 - 0.5 - 0.25, 3.0, 3.0]]
    params = SamplingParams(frequency_penalty=0.1, presence_penalty=0.1)
    seen = [3, 3, 0]  # a prompt of [3, 3], then 0 generated
    assert sample(torch.tensor([[3.0, 0.0, 0.0, 3.05]]), [params], [0], [seen], [0], [2]).token_ids == [3]
    # Without the prompt length, every seen token counts: 3 (twice) now falls below 0 (once).
    assert sample(torch.tensor([[3.0, 0.0, 0.0, 3.05]]), [params], [0], [seen], [0]).token_ids == [0]


def test_penalties_and_bias_of_one_row_do_not_reach_the_others() -> None:
    """Batch invariance: a row's tokens depend on its own parameters and history, not on its neighbours'."""
    torch.manual_seed(1)
    logits = torch.randn(4, 64)
    params = [
        SamplingParams(temperature=0.9, presence_penalty=1.5, frequency_penalty=-0.5, logit_bias={3: 5.0}),
        SamplingParams(),
        SamplingParams(temperature=0.7, top_k=10, logit_bias={int(logits[2].argmax()): -100.0}),
        SamplingParams(frequency_penalty=2.0, repetition_penalty=1.3),
    ]
    seeds, prompt_lens = [11, 12, 13, 14], [3, 0, 1, 2]
    histories: list[list[int]] = [[5, 6, 7], [], [9], [1, 2]]
    alone = [list(h) for h in histories]
    for _ in range(12):
        step = sample(logits, params, seeds, histories, [2] * 4, prompt_lens)
        for row in range(4):
            single = sample(
                logits[row : row + 1],
                params[row : row + 1],
                seeds[row : row + 1],
                [alone[row]],
                [2],
                prompt_lens[row : row + 1],
            )
            assert single.token_ids[0] == step.token_ids[row] and single.logprobs[0] == step.logprobs[row]
            assert single.top_logprobs[0] == step.top_logprobs[row]
            histories[row].append(step.token_ids[row])
            alone[row].append(single.token_ids[0])
    assert histories == alone


def test_rows_that_ask_for_no_logprobs_get_the_same_tokens_and_none() -> None:
    """A step where no row asks for logprobs skips the log-softmax: the tokens are those sampled with
    every row's logprob computed, and a row that asks gets the same value whatever its neighbours ask."""
    torch.manual_seed(3)
    logits = torch.randn(3, 257)
    params = [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(repetition_penalty=1.2)]
    args = ([7, 8, 9], [[1, 2], [3], [4, 5, 6]], [0, 0, 0])
    every = sample(logits, params, *args)
    none = sample(logits, params, *args, logprobs=[False, False, False])
    assert none.token_ids == every.token_ids
    assert none.logprobs == [None, None, None] and none.top_logprobs == [[], [], []]
    some = sample(logits, params, *args, logprobs=[False, True, False])
    assert some.token_ids == every.token_ids
    assert some.logprobs == [None, every.logprobs[1], None]


def test_top_k_and_top_p_draw_only_among_a_constraints_allowed_tokens() -> None:
    """A constraint leaves a few tokens (the rest -inf): top-k larger than them, and top-p over them, still
    draw only those, and exactly equal logits (a flat row) keep every token in the nucleus."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(1, 5000, generator=gen)
    allowed_ids = [7, 1234, 4999]
    mask = torch.zeros(1, 5000, dtype=torch.bool)
    mask[0, allowed_ids] = True
    for params in (
        SamplingParams(temperature=1.0, top_k=50),
        SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(temperature=2.0, top_k=50, top_p=0.99),
    ):
        drawn = {sample(logits, [params], [seed], [[]], [0], allowed=([0], mask)).token_ids[0] for seed in range(200)}
        assert drawn <= set(allowed_ids) and len(drawn) >= 2, (params, drawn)
    flat = nucleus(torch.zeros(1000), 0, 0.5)
    assert flat is not None and len(flat) == 1000
