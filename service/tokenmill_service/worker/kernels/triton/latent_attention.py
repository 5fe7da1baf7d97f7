"""Multi-head latent attention (DeepSeek-V2/V3's MLA) in the absorbed form over the paged latent cache,
for decode tokens and prefill chunks alike: the computation of worker/kernels/latent_attention.py (the torch
reference) as one Triton kernel.

A program takes a tile of ``BLOCK_Q`` query rows of one sequence and one head ``h`` (from a group's
padded ``[S_g, max_q]`` grid, as triton/attention.py does): it folds the key up-projection into the
queries (``q_nope @ w_uk[h]``, one product), visits the sequence's cached latents and rotary keys
through its block table in splits of ``SPLIT_KEYS`` absolute positions, tiles of ``BLOCK_N`` keys
inside each, scoring ``q_lat . c + q_rope . k_rope``, keeps an online softmax per split from
scratch and folds the splits together in order, then applies the value up-projection to the
weighted latents (``@ w_uv[h]``). Every product has a tile shape fixed by the model (never by the
batch), the splits and tiles lie at fixed absolute positions, and a key past a row's position adds
exact zeros: a query's result depends only on its sequence, its position and the constants here,
not on the batch around it or on whether its prefix was prefilled or decoded.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl

from tokenmill_service.worker.kernels.attention_metadata import AttentionGroup, AttentionMetadata
from tokenmill_service.worker.kernels.attention_params import LatentAttentionParams, LatentCache
from tokenmill_service.worker.kernels.triton.paged_tiles import SPLIT_KEYS, check_split_keys, key_tile, tile_rows
from tokenmill_service.worker.kernels.triton.softmax_state import combine, empty_state, finish, online_softmax_step

# @triton.jit is untyped, and the kernels' parameters stay unannotated (triton reads a parameter's
# annotation to choose how it specialises the kernel), hence their narrow type-ignores.

BLOCK_N = 32  # keys per tile inside a split
BLOCK_Q = 16  # query rows of a tile; tl.dot needs at least 16 on a GPU


@triton.jit  # type: ignore[untyped-decorator]
def _split_partial(  # type: ignore[no-untyped-def]
    q_lat, q_rope, pos, lo, hi, scale,
    latent_ptr, rope_ptr, table_ptr,
    stride_lb, stride_lo,
    stride_rb, stride_ro,
    latent_dim, rope_dim,
    BLOCK_M: tl.constexpr, L_PAD: tl.constexpr, R_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Softmax state of rows (q_lat [BLOCK_M, L_PAD], q_rope [BLOCK_M, R_PAD], positions pos) over
    keys lo..hi-1, from scratch: a row sees the keys at most its position. The latents are the values."""
    dl = tl.arange(0, L_PAD)
    dr = tl.arange(0, R_PAD)
    m, l, acc = empty_state(BLOCK_M, L_PAD)
    for start in range(lo, hi, BLOCK_N):
        keys, in_range, block, slot = key_tile(table_ptr, start, hi, BLOCK_SIZE, BLOCK_N)
        c_off = block[:, None] * stride_lb + slot[:, None] * stride_lo + dl[None, :]
        c = tl.load(latent_ptr + c_off, mask=in_range[:, None] & (dl < latent_dim)[None, :], other=0.0)
        c = c.to(tl.float32)
        r_off = block[:, None] * stride_rb + slot[:, None] * stride_ro + dr[None, :]
        kr = tl.load(rope_ptr + r_off, mask=in_range[:, None] & (dr < rope_dim)[None, :], other=0.0)
        kr = kr.to(tl.float32)
        scores = tl.dot(q_lat, tl.trans(c), input_precision="ieee")
        scores = (scores + tl.dot(q_rope, tl.trans(kr), input_precision="ieee")) * scale
        visible = in_range[None, :] & (keys[None, :] <= pos[:, None])
        m, l, acc = online_softmax_step(m, l, acc, tl.where(visible, scores, float("-inf")), c)
    return m, l, acc


@triton.jit  # type: ignore[untyped-decorator]
def _every_split(  # type: ignore[no-untyped-def]
    q_lat, q_rope, pos, keys_end, scale, latent_ptr, rope_ptr, table_ptr, stride_lb, stride_lo, stride_rb,
    stride_ro, latent_dim, rope_dim,
    BLOCK_M: tl.constexpr, L_PAD: tl.constexpr, R_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    """A program's pass over its sequence's keys, split by split, combined in order: the softmax-weighted
    latents [BLOCK_M, L_PAD] (0 in rows that are not stored)."""
    m_run, l_run, acc_run = empty_state(BLOCK_M, L_PAD)
    for lo in range(0, keys_end, SPLIT):
        m, l, acc = _split_partial(
            q_lat, q_rope, pos, lo, tl.minimum(lo + SPLIT, keys_end), scale, latent_ptr, rope_ptr, table_ptr,
            stride_lb, stride_lo, stride_rb, stride_ro, latent_dim, rope_dim, BLOCK_M, L_PAD, R_PAD, BLOCK_SIZE,
            BLOCK_N,
        )  # fmt: skip
        m_run, l_run, acc_run = combine(m_run, l_run, acc_run, m, l, acc)
    return finish(l_run, acc_run)


@triton.jit  # type: ignore[untyped-decorator]
def _latent_attention_kernel(  # type: ignore[no-untyped-def]
    q_nope_ptr, q_rope_ptr, latent_ptr, rope_ptr, w_uk_ptr, w_uv_ptr, out_ptr,
    token_index_ptr, positions_ptr, block_ids_ptr,
    scale,
    max_q, num_q_tiles, table_width,
    nope_dim, latent_dim, rope_dim, v_dim,
    stride_nt, stride_nh,
    stride_rt, stride_rh,
    stride_ot, stride_oh,
    stride_lb, stride_lo,
    stride_rb, stride_ro,
    stride_kh, stride_kn, stride_kl,
    stride_vh, stride_vl, stride_vv,
    BLOCK_M: tl.constexpr, N_PAD: tl.constexpr, L_PAD: tl.constexpr, R_PAD: tl.constexpr, V_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0) // num_q_tiles
    head = tl.program_id(1)
    # One query head a row: the grid's rows with groups of one head (G = G_PAD = 1).
    _cell, token, pos, real, _head = tile_rows(
        token_index_ptr, positions_ptr, seq, tl.program_id(0) % num_q_tiles, head, max_q, 1, 1, BLOCK_M, BLOCK_M
    )
    dn = tl.arange(0, N_PAD)
    dl = tl.arange(0, L_PAD)
    dr = tl.arange(0, R_PAD)
    dv = tl.arange(0, V_PAD)
    n_off = token[:, None] * stride_nt + head * stride_nh + dn[None, :]
    q_nope = tl.load(q_nope_ptr + n_off, mask=real[:, None] & (dn < nope_dim)[None, :], other=0.0).to(tl.float32)
    r_off = token[:, None] * stride_rt + head * stride_rh + dr[None, :]
    q_rope = tl.load(q_rope_ptr + r_off, mask=real[:, None] & (dr < rope_dim)[None, :], other=0.0).to(tl.float32)
    # The key up-projection folded into the queries: w_uk[head] is [nope, latent] (any strides).
    w_off = head.to(tl.int64) * stride_kh + dn[:, None] * stride_kn + dl[None, :] * stride_kl
    w_uk = tl.load(w_uk_ptr + w_off, mask=(dn < nope_dim)[:, None] & (dl < latent_dim)[None, :], other=0.0)
    q_lat = tl.dot(q_nope, w_uk, input_precision="ieee")
    keys_end = tl.max(pos, axis=0) + 1
    table_ptr = block_ids_ptr + seq.to(tl.int64) * table_width
    o_lat = _every_split(
        q_lat, q_rope, pos, keys_end, scale, latent_ptr, rope_ptr, table_ptr, stride_lb, stride_lo, stride_rb,
        stride_ro, latent_dim, rope_dim, BLOCK_M, L_PAD, R_PAD, BLOCK_SIZE, BLOCK_N, SPLIT,
    )  # fmt: skip
    # The value up-projection: w_uv[head] is [latent, v] (any strides).
    w_off = head.to(tl.int64) * stride_vh + dl[:, None] * stride_vl + dv[None, :] * stride_vv
    w_uv = tl.load(w_uv_ptr + w_off, mask=(dl < latent_dim)[:, None] & (dv < v_dim)[None, :], other=0.0)
    out = tl.dot(o_lat, w_uv, input_precision="ieee")
    o_off = token[:, None] * stride_ot + head * stride_oh + dv[None, :]
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=real[:, None] & (dv < v_dim)[None, :])


def _pad(n: int) -> int:
    return max(16, int(triton.next_power_of_2(n)))


def _group_latent_attention(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    cache: LatentCache,
    group: AttentionGroup,
    params: LatentAttentionParams,
    out: torch.Tensor,
    split_keys: int,
) -> None:
    latent_cache, rope_cache, w_uk, w_uv = cache.latents, cache.rope_keys, params.w_uk, params.w_uv
    num_seqs, max_q = group.token_index.shape
    heads, nope_dim, latent_dim = w_uk.shape
    rope_dim, v_dim = rope_cache.shape[-1], w_uv.shape[-1]
    block_size = latent_cache.shape[1]
    num_q_tiles = triton.cdiv(max_q, BLOCK_Q)
    _latent_attention_kernel[(num_seqs * num_q_tiles, heads)](
        q_nope, q_rope, latent_cache, rope_cache, w_uk, w_uv, out,
        group.token_index, group.query_positions, group.block_ids,
        params.scale, max_q, num_q_tiles, group.block_ids.shape[1], nope_dim, latent_dim, rope_dim, v_dim,
        q_nope.stride(0), q_nope.stride(1), q_rope.stride(0), q_rope.stride(1), out.stride(0), out.stride(1),
        latent_cache.stride(0), latent_cache.stride(1), rope_cache.stride(0), rope_cache.stride(1),
        *w_uk.stride(), *w_uv.stride(),
        BLOCK_M=BLOCK_Q, N_PAD=_pad(nope_dim), L_PAD=_pad(latent_dim), R_PAD=_pad(rope_dim), V_PAD=_pad(v_dim),
        BLOCK_SIZE=block_size, BLOCK_N=min(BLOCK_N, split_keys), SPLIT=split_keys,
    )  # fmt: skip


def latent_attention(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    cache: LatentCache,
    meta: AttentionMetadata,
    params: LatentAttentionParams,
    split_keys: int = SPLIT_KEYS,
) -> torch.Tensor:
    """As ``Ops.latent_attention``: [T, H, V] in q_nope's dtype; caches [blocks, block_size, 1, L] and
    [blocks, block_size, 1, R] (``LatentCacheLayout``)."""
    check_split_keys(split_keys)
    if any(x.stride(-1) != 1 for x in (q_nope, q_rope, cache.latents, cache.rope_keys)):
        raise ValueError("the triton latent attention kernel needs the queries and caches contiguous in their last dim")
    params = replace(params, w_uk=params.w_uk.float(), w_uv=params.w_uv.float())  # any strides (kv_b_proj's views)
    out = torch.empty(*q_nope.shape[:2], params.w_uv.shape[-1], dtype=q_nope.dtype, device=q_nope.device)
    for group in meta.groups:
        _group_latent_attention(q_nope, q_rope, cache, group, params, out, split_keys)
    return out
