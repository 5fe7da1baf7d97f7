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

import torch

from tokenmill_service.engine.request import SamplingParams


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


def top_k_top_p_mask(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf every logit outside the row's top-k set and outside its top-p nucleus.

    top_k: [B] int, 0 = off. top_p: [B] float, values >= 1 (or <= 0) = off.
    """
    vocab = logits.shape[-1]
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device).expand_as(sorted_logits)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    remove = ranks >= k[:, None]
    probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
    # Keep the smallest prefix whose mass reaches p: drop a token when the mass before it already does.
    mass_before = probs.cumsum(dim=-1) - probs
    p = torch.where((top_p > 0) & (top_p < 1), top_p, torch.ones_like(top_p))
    remove |= (mass_before >= p[:, None]) & (ranks > 0)
    mask = torch.zeros_like(remove).scatter(-1, sorted_idx, remove)
    return logits.masked_fill(mask, float("-inf"))


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
    logprobs_all = torch.log_softmax(logits, dim=-1) if n_max > 0 or any(want) else None
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

    greedy = [p.greedy for p in params]
    chosen = work.argmax(dim=-1)
    sampled_rows = [i for i, g in enumerate(greedy) if not g]
    if sampled_rows:
        rows = torch.tensor(sampled_rows, dtype=torch.long, device=device)
        temps = torch.tensor([params[i].temperature for i in sampled_rows], dtype=torch.float32, device=device)
        top_k = torch.tensor([params[i].top_k for i in sampled_rows], dtype=torch.long, device=device)
        top_p = torch.tensor([params[i].top_p for i in sampled_rows], dtype=torch.float32, device=device)
        scaled = work[rows] / temps[:, None]
        probs = top_k_top_p_mask(scaled, top_k, top_p).softmax(dim=-1).double()
        cdf = probs.cumsum(dim=-1)
        draws = [keyed_uniform(seeds[i], len(seen_tokens[i])) for i in sampled_rows]
        u = torch.tensor(draws, dtype=torch.float64, device=device)
        # Inverse CDF: the first token whose cumulative mass exceeds u (scaled to the row's total).
        picks = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(1)
        # Guard against rounding past the last nonzero entry.
        picks = torch.minimum(picks, (probs > 0).long().cumsum(-1).argmax(-1))
        chosen[rows] = picks

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
