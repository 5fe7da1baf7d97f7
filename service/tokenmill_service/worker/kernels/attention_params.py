"""A layer's attention parameters: what an attention op takes beside the step's queries, cache and metadata.

The attention layer builds its value once (worker/models/), and every backend's ``attention`` or
``latent_attention`` takes it whole, so a new option is one field here, not a parameter in each backend's
signature. Frozen: the same value serves every step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class AttentionParams:
    """A layer's causal attention over its KV cache (``Ops.attention``).

    ``scale`` multiplies each score. ``window``: a query at position p sees only p - window + 1 .. p (a
    sliding-window layer; None: the whole context). ``softcap``: each scaled score s becomes
    tanh(s / softcap) * softcap before the softmax (Gemma 2's logit soft-capping). ``sinks`` [H] float32
    (gpt-oss's attention sinks): head h's softmax over a query's scores s_j gets one more logit, ``sinks[h]``,
    that weighs no value: out = sum_j e^{s_j} v_j / (sum_j e^{s_j} + e^{sinks[h]})."""

    scale: float
    window: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class LatentCache:
    """One layer's cache for multi-head latent attention (``LatentCacheLayout``): ``latents`` [blocks,
    block_size, 1, L] (the compressed latent every head shares) and ``rope_keys`` [blocks, block_size, 1, R]
    (the rotary keys), each token's in its slot."""

    latents: torch.Tensor
    rope_keys: torch.Tensor


@dataclass(frozen=True, slots=True)
class LatentAttentionParams:
    """A layer's multi-head latent attention in the absorbed form (``Ops.latent_attention``): ``w_uk`` [H, N, L]
    the key up-projection (folded into the query), ``w_uv`` [H, L, V] the value up-projection (applied after
    attention), float32, any strides (the model's are views of kv_b_proj's weight [H, N + V, L]); ``scale``
    multiplies each score."""

    w_uk: torch.Tensor
    w_uv: torch.Tensor
    scale: float
