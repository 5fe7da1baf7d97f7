"""The batched sampler: greedy, temperature, top-k, top-p, repetition penalty, seeds."""

from __future__ import annotations

import math

import torch

from tokenmill_service.engine.request import SamplingParams
from tokenmill_service.engine.sampler import apply_repetition_penalty, sample, top_k_top_p_mask


def _gens(n: int, seed: int = 0) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed + i) for i in range(n)]


def test_greedy_picks_the_argmax_and_reports_raw_logprobs() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]])
    out = sample(logits, [SamplingParams(), SamplingParams()], _gens(2), [[], []], [2, 0])
    assert out.token_ids == [1, 0]
    expected = torch.log_softmax(logits, -1)
    assert math.isclose(out.logprobs[0], expected[0, 1].item(), rel_tol=1e-6)
    assert [i for i, _ in out.top_logprobs[0]] == [1, 2]
    assert out.top_logprobs[1] == []


def test_top_k_never_picks_outside_the_k_most_likely() -> None:
    torch.manual_seed(0)
    logits = torch.randn(1, 50)
    allowed = set(logits[0].topk(5).indices.tolist())
    gen = torch.Generator().manual_seed(1)
    params = SamplingParams(temperature=5.0, top_k=5)  # a flat distribution tempts every token
    for _ in range(500):
        tok = sample(logits, [params], [gen], [[]], [0]).token_ids[0]
        assert tok in allowed


def test_top_p_never_picks_outside_the_nucleus() -> None:
    probs = torch.tensor([0.5, 0.3, 0.1, 0.05, 0.05])
    logits = probs.log()[None, :]
    gen = torch.Generator().manual_seed(2)
    params = SamplingParams(temperature=1.0, top_p=0.75)  # nucleus: tokens 0 and 1 (0.5 + 0.3 >= 0.75)
    seen = {sample(logits, [params], [gen], [[]], [0]).token_ids[0] for _ in range(500)}
    assert seen == {0, 1}


def test_top_p_mask_keeps_at_least_the_best_token() -> None:
    logits = torch.tensor([[10.0, 0.0, 0.0]])
    masked = top_k_top_p_mask(logits, torch.tensor([0]), torch.tensor([0.01]))
    assert torch.isfinite(masked[0, 0]) and torch.isinf(masked[0, 1:]).all()


def test_temperature_sampling_frequencies_match_the_softmax() -> None:
    logits = torch.tensor([[1.0, 0.5, 0.0, -1.0]])
    temperature = 0.8
    expected = torch.softmax(logits[0] / temperature, -1)
    gen = torch.Generator().manual_seed(1234)
    params = SamplingParams(temperature=temperature)
    draws = 20000
    counts = torch.zeros(4)
    for _ in range(draws):
        counts[sample(logits, [params], [gen], [[]], [0]).token_ids[0]] += 1
    # Pearson chi-square with 3 degrees of freedom; 16.27 is the 0.1% critical value.
    chi2 = (((counts - draws * expected) ** 2) / (draws * expected)).sum().item()
    assert chi2 < 16.27, (counts / draws, expected)


def test_same_seed_same_tokens_whatever_the_batch() -> None:
    torch.manual_seed(0)
    logits = torch.randn(8, 100)
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=7)] * 8

    def draw_alone(row: int) -> list[int]:
        gen = torch.Generator().manual_seed(42)
        return [sample(logits[row : row + 1], params[:1], [gen], [[]], [0]).token_ids[0] for _ in range(20)]

    gens = [torch.Generator().manual_seed(42) for _ in range(8)]
    batched = [sample(logits, params, gens, [[]] * 8, [0] * 8).token_ids for _ in range(20)]
    for row in range(8):
        assert [step[row] for step in batched] == draw_alone(row)


def test_repetition_penalty_lowers_seen_tokens_both_signs() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0]])
    out = apply_repetition_penalty(logits.clone(), [[0, 1]], [2.0])
    assert out.tolist() == [[1.0, -4.0, 1.0]]
    unchanged = apply_repetition_penalty(logits.clone(), [[0, 1]], [1.0])
    assert torch.equal(unchanged, logits)


def test_greedy_with_repetition_penalty_avoids_the_repeat() -> None:
    logits = torch.tensor([[2.0, 1.9, 0.0]])
    params = SamplingParams(repetition_penalty=1.5)
    assert sample(logits, [params], _gens(1), [[0]], [0]).token_ids == [1]
