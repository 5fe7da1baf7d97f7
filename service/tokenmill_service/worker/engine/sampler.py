"""Batched sampling with per-request parameters, in one pass over the batch's logits.

Reported logprobs are those of the model's own distribution (log-softmax of the raw logits),
not of the distribution after temperature, top-k, top-p, the penalties, the logit bias or a
constraint's token mask: they score the text, whatever way it was drawn.

Every edit of a row's logits (logit bias, then the repetition, frequency and presence penalties)
reads only that row's parameters and tokens, so a sequence's result never depends on its batch.

Each sampled token inverts the CDF at one uniform number that is a pure function of the
request's seed and the token's position (a counter-based draw, splitmix64): no generator state
to carry, nothing device-specific, so a seeded request gets the same tokens alone or in any batch,
on any device, and after being resumed elsewhere from its generated prefix.

Every tensor made here lives on the logits' device.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import numpy as np
import torch

from tokenmill_service.contract.request import SamplingParams
from tokenmill_service.worker.kernels import argmax_rows, log_softmax, softmax


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    # Per row: the chosen token's logprob; None for a row that did not ask (``sample``'s ``logprobs``).
    logprobs: list[float | None]
    # Per row: (ids, logprobs) of the `top_n[i]` most likely tokens, best first.
    top_logprobs: list[list[tuple[int, float]]]


_MASK64 = (1 << 64) - 1


def keyed_uniform(seed: int, position: int) -> float:
    """A uniform number in [0, 1) determined by (seed, position): splitmix64 of the pair."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return (z >> 11) / float(1 << 53)


def apply_repetition_penalty(logits: torch.Tensor, seen: Seq[Seq[int]], penalties: Seq[float]) -> torch.Tensor:
    """Hugging Face's rule: a seen token's positive logit is divided by the penalty, a negative one multiplied."""
    for row, (ids, penalty) in enumerate(zip(seen, penalties)):
        if penalty in (0.0, 1.0) or not ids:
            continue
        idx = torch.tensor(sorted(set(ids)), dtype=torch.long, device=logits.device)
        vals = logits[row, idx]
        logits[row, idx] = torch.where(vals > 0, vals / penalty, vals * penalty)
    return logits


def apply_logit_bias(logits: torch.Tensor, biases: Seq[dict[int, float]]) -> torch.Tensor:
    """OpenAI's logit_bias: each row's bias added to its tokens' logits (-100 bans a token, 100 forces it)."""
    for row, bias in enumerate(biases):
        if not bias:
            continue
        ids = sorted(bias)
        idx = torch.tensor(ids, dtype=torch.long, device=logits.device)
        logits[row, idx] += torch.tensor([bias[i] for i in ids], dtype=logits.dtype, device=logits.device)
    return logits


def apply_frequency_presence_penalties(
    logits: torch.Tensor, generated: Seq[Seq[int]], frequency: Seq[float], presence: Seq[float]
) -> torch.Tensor:
    """OpenAI's rule: logit -= count * frequency_penalty + (count > 0) * presence_penalty, where count is
    how often the token was generated so far (the prompt's tokens do not count)."""
    for row, (ids, freq, pres) in enumerate(zip(generated, frequency, presence)):
        if (freq == 0.0 and pres == 0.0) or not ids:
            continue
        counts: dict[int, int] = {}
        for t in ids:
            counts[t] = counts.get(t, 0) + 1
        tokens = sorted(counts)
        idx = torch.tensor(tokens, dtype=torch.long, device=logits.device)
        n = torch.tensor([counts[t] for t in tokens], dtype=logits.dtype, device=logits.device)
        logits[row, idx] -= n * freq + pres
    return logits


def nucleus(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor | None:
    """The token ids one row (``scaled``: [vocab], its logits over the temperature) may draw from under
    top-k and top-p; None where neither restricts it (``top_k`` 0 or at least the vocabulary, ``top_p`` at
    least 1 or at most 0).

    Top-k keeps the k largest logits. Top-p then keeps the shortest run of those, most likely first, whose
    mass reaches p (a token is dropped when the mass before it already does; the first is always kept): the
    mass within the top-k set where top-k is on, else within the whole vocabulary, where every token as
    likely as the run's last is kept too (so ties at the edge need no order).

    Without top-k the run is looked for among the 64 most likely tokens, and only then among all the tokens
    that can be in it, sorted (their probabilities, not their indices): a model's nucleus is mostly a few
    tokens to a few hundred, and a full sort with indices of a 128k vocabulary took 10 ms (of a 13 ms
    sampling step, against 22 ms for a 1B model's forward pass). The masses are summed most likely first
    either way, so the answer is the same: a function of the row alone, whatever the batch."""
    vocab = scaled.shape[-1]
    k = top_k if 0 < top_k < vocab else 0
    p_on = 0 < top_p < 1
    if not k and not p_on:
        return None
    if k:
        top = scaled.topk(k)
        if not p_on:
            return top.indices
        return top.indices[: _nucleus_length(softmax(top.values), top_p, complete=True)]
    probs = softmax(scaled)
    likeliest = probs.topk(min(vocab, 64)).values
    length = _nucleus_length(likeliest, top_p, complete=len(likeliest) == vocab)
    if not length:
        # Only tokens at least (1 - p) / (2 vocab) likely can be in it: those below hold less than (1 - p) / 2
        # of the mass together. They are the most likely tokens, so their sums run as over the whole row.
        likeliest = _descending(probs[probs >= (1 - top_p) / (2 * vocab)])
        length = _nucleus_length(likeliest, top_p, complete=True)
    return (probs >= likeliest[length - 1]).nonzero().flatten()


def _descending(values: torch.Tensor) -> torch.Tensor:
    """A 1-d tensor's values sorted, largest first (on the CPU numpy's vectorized sort: 3 ms for 128k
    floats against torch's 10)."""
    if values.device.type != "cpu":
        return values.sort(descending=True).values
    return torch.from_numpy(np.sort(values.detach().numpy())[::-1].copy())


def _nucleus_length(probs: torch.Tensor, top_p: float, *, complete: bool) -> int:
    """How many of ``probs`` (most likely first) the nucleus of mass ``top_p`` (in (0, 1)) keeps: up to the
    first token whose mass before it reaches p (never the first token: nothing comes before it). 0 when all of
    them are kept and more may be (not ``complete``: the candidates are not the whole set)."""
    reached = (probs.cumsum(dim=-1) - probs) >= top_p
    if bool(reached.any()):
        return int(reached.int().argmax())
    return probs.shape[-1] if complete else 0


def draw_token(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, u: float) -> torch.Tensor:
    """One row's sampled token (a 0-d long tensor): its logits [vocab] over the temperature, outside the
    nucleus (top-k, top-p) out of reach, softmaxed; the inverse of their cumulative sum (float64, in the
    vocabulary's order) at ``u`` (in [0, 1)) times the total."""
    scaled = logits / temperature  # a new tensor: the caller's logits stay as they were
    kept = nucleus(scaled, top_k, top_p)
    if kept is not None:  # every other token out of reach
        scaled = torch.full_like(scaled, float("-inf")).index_copy_(0, kept, scaled[kept])
    probs = softmax(scaled)
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)
    pick = torch.searchsorted(cdf, cdf[-1:] * u, right=True)[0]
    # u * total can round up to the total: then the last token with any mass (rare: checked, not computed).
    if int(pick) >= len(probs):
        pick = len(probs) - 1 - (probs > 0).flip(0).long().argmax()
    return pick


def sample(
    logits: torch.Tensor,
    params: Seq[SamplingParams],
    seeds: Seq[int],
    seen_tokens: Seq[Seq[int]],
    top_n: Seq[int],
    prompt_lens: Seq[int] | None = None,
    allowed: tuple[Seq[int], torch.Tensor] | None = None,
    logprobs: Seq[bool] | None = None,
) -> SamplerOutput:
    """logits: float32 [B, vocab], one row per sequence that gets a new token this step;
    ``seen_tokens[i]`` is row i's sequence so far (its length is the position being sampled), of which
    the first ``prompt_lens[i]`` are its prompt (None: no prompt, every seen token was generated).
    ``allowed``: (rows, bool [len(rows), vocab]) the only tokens those rows may choose (a constraint's mask),
    applied after the penalties and before temperature, top-k and top-p.
    ``logprobs``: which rows report their chosen token's logprob (None: every row). When no row asks for
    one nor for top alternatives, the log-softmax over the vocabulary is skipped (the usual decode step);
    when any does, it is computed for every row as always, so a row's values never depend on its batch."""
    device = logits.device
    n_max = max(top_n, default=0)
    want = [True] * len(params) if logprobs is None else list(logprobs)
    logprobs_all = log_softmax(logits) if n_max > 0 or any(want) else None
    # The edits work on a copy; without any (the usual case) the logits are read as they are.
    work = logits
    if any(p.edits_logits for p in params):
        work = apply_logit_bias(logits.clone(), [p.logit_bias for p in params])
        work = apply_repetition_penalty(work, seen_tokens, [p.repetition_penalty for p in params])
        starts = prompt_lens if prompt_lens is not None else [0] * len(params)
        work = apply_frequency_presence_penalties(
            work,
            [seen[start:] for seen, start in zip(seen_tokens, starts)],
            [p.frequency_penalty for p in params],
            [p.presence_penalty for p in params],
        )
    if allowed is not None and len(allowed[0]):
        rows_t = torch.tensor(list(allowed[0]), dtype=torch.long, device=device)
        work = work.clone() if work is logits else work
        work[rows_t] = work[rows_t].masked_fill(~allowed[1], float("-inf"))

    sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
    # The argmax (a pass over the vocabulary a row) only where some row is greedy: the first maximal index, as
    # max's indices give it (a third of argmax's time: 64 rows of 128,256 1.9 ms against 5.7), natively on the
    # CPU in a fifth of max's again (one row of 128,256: 45 us against 215, an AMD EPYC).
    every_sampled = len(sampled_rows) == len(params)
    chosen = torch.empty(len(params), dtype=torch.long, device=device) if every_sampled else argmax_rows(work)
    # Row by row: a row's vocabulary-long passes stay in the caches (a batch of 16 rows of 128k, its float64
    # sums 16 MB, took 3.5 times as long a row as one row alone).
    for i in sampled_rows:
        draw = keyed_uniform(seeds[i], len(seen_tokens[i]))
        chosen[i] = draw_token(work[i], params[i].temperature, params[i].top_k, params[i].top_p, draw)

    token_ids = chosen.tolist()
    tops: list[list[tuple[int, float]]] = [[] for _ in token_ids]
    if logprobs_all is None:
        return SamplerOutput(token_ids=token_ids, logprobs=[None] * len(token_ids), top_logprobs=tops)
    gathered = logprobs_all.gather(1, chosen[:, None]).squeeze(1).tolist()
    chosen_lp: list[float | None] = [lp if w else None for lp, w in zip(gathered, want)]
    if n_max > 0:
        vals, idx = logprobs_all.topk(min(n_max, logits.shape[-1]), dim=-1)
        vals_l, idx_l = vals.tolist(), idx.tolist()
        for row, n in enumerate(top_n):
            tops[row] = list(zip(idx_l[row][:n], vals_l[row][:n]))
    return SamplerOutput(token_ids=token_ids, logprobs=chosen_lp, top_logprobs=tops)
