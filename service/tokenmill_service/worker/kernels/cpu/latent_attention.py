"""Multi-head latent attention on the CPU in the absorbed form, each query row on its own in a fixed
order (latent_attention.cpp): the same computation as worker/kernels/latent_attention.py's torch reference
(the key up-projection folded into the query, attention over the cached latents and rotary keys,
the value up-projection after), within float32 rounding of it, and bitwise the same for a query
whatever its batch and whether its position was prefilled or decoded.

It reads the reference's latent cache layout (``LatentCacheLayout``: [blocks, block_size, 1, L] and
[blocks, block_size, 1, R], float32 or float16), so the reference's ``store_latent`` writes it."""

from __future__ import annotations

import torch

from tokenmill_service.worker.kernels.attention_params import LatentAttentionParams, LatentCache
from tokenmill_service.worker.kernels.cpu import build
from tokenmill_service.worker.kernels.cpu.paged_attention import CACHE_DTYPES


def unavailable_reason() -> str | None:
    return build.unavailable_reason("latent_attention")


def fits(q_nope: torch.Tensor, q_rope: torch.Tensor, cache: LatentCache, params: LatentAttentionParams) -> bool:
    """Whether the kernel takes these: float32 queries and weights on the CPU, each query's last
    dimension contiguous, w_uk's last and one of w_uv's last two (a copy, or a view of kv_b_proj's
    rows), contiguous caches of a dtype it reads, latent, rotary and value dims in
    whole vectors of 16, and the kernel built."""
    latent_cache, rope_cache, w_uk, w_uv = cache.latents, cache.rope_keys, params.w_uk, params.w_uv
    latent, rope, v = latent_cache.shape[-1], rope_cache.shape[-1], w_uv.shape[-1]
    return (
        all(x.device.type == "cpu" for x in (q_nope, q_rope, latent_cache, rope_cache, w_uk, w_uv))
        and all(x.dtype == torch.float32 for x in (q_nope, q_rope, w_uk, w_uv))
        and latent_cache.dtype in CACHE_DTYPES
        and rope_cache.dtype == latent_cache.dtype
        and latent_cache.is_contiguous()
        and rope_cache.is_contiguous()
        and q_nope.stride(-1) == 1
        and q_rope.stride(-1) == 1
        and w_uk.stride(-1) == 1
        and 1 in w_uv.stride()[1:]
        and latent % 16 == 0
        and rope % 16 == 0
        and v % 16 == 0
        and unavailable_reason() is None
    )


def latent_attention(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    cache: LatentCache,
    params: LatentAttentionParams,
    positions: torch.Tensor,
    seq_of_token: torch.Tensor,
    block_tables: torch.Tensor,
) -> torch.Tensor:
    """q_nope [T, H, N], q_rope [T, H, R] (rotated) float32 -> [T, H, V] float32: token i (at
    ``positions[i]`` of sequence ``seq_of_token[i]``) attends over that sequence's keys 0..positions[i],
    found through ``block_tables`` [S, W] in the caches (this step's latents already stored), as
    ``Ops.latent_attention``. ``fits`` must hold."""
    latent_cache, rope_cache, w_uk, w_uv = cache.latents, cache.rope_keys, params.w_uk, params.w_uv
    t, heads, nope = q_nope.shape
    latent, rope, v = latent_cache.shape[-1], rope_cache.shape[-1], w_uv.shape[-1]
    assert w_uk.shape == (heads, nope, latent) and w_uv.shape == (heads, latent, v), (w_uk.shape, w_uv.shape)
    out = torch.empty(t, heads, v)
    if t:
        kernel = getattr(build.load("latent_attention"), "tm_latent_attention" + CACHE_DTYPES[latent_cache.dtype])
        rc = kernel(
            q_nope.data_ptr(), q_nope.stride(0), q_nope.stride(1),
            q_rope.data_ptr(), q_rope.stride(0), q_rope.stride(1),
            t, heads, nope, latent, rope, v,
            w_uk.data_ptr(), w_uk.stride(0), w_uk.stride(1),
            w_uv.data_ptr(), w_uv.stride(0), w_uv.stride(1), w_uv.stride(2),
            latent_cache.data_ptr(), rope_cache.data_ptr(), latent_cache.shape[1],
            positions.data_ptr(), seq_of_token.data_ptr(), block_tables.data_ptr(), block_tables.shape[1],
            params.scale, out.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        if rc:
            raise ValueError(
                f"native latent attention takes latent, rope and v dims in 16s (not {latent, rope, v}) and w_uv "
                f"contiguous in one of its last two dims (not strides {w_uv.stride()})"
            )
    return out
