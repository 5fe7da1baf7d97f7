"""Paged attention over the KV cache for decode tokens and prefill chunks alike, flash-decoding style.

One kernel serves both groups of ``AttentionMetadata``. A program takes a tile of query rows
(``BLOCK_Q`` queries of one sequence times the ``G`` query heads that share one KV head) and
visits keys through the sequence's block table in splits of ``SPLIT_KEYS`` absolute positions,
tiles of ``BLOCK_N`` keys inside each split. For each split it computes a partial softmax state
(max, denominator, weighted values) from scratch, then folds the splits together in order.

- Decode (one query per sequence): one program per split, the partial states go to memory,
  and a second pass (``_reduce_splits_kernel``) folds them in split order: the key length is
  spread over many programs, as in flash-decoding.
- Prefill chunks: one program folds all its splits itself; no partial states in memory.

Both do exactly the same arithmetic per query row, in the same order, with the same tile
shapes, and a split or tile beyond a query's position, or wholly before its sliding window (which
is why such splits are skipped), adds exact zeros: a query's result depends
only on its sequence, its position and the constants here, never on the batch around it or on
whether its prefix was prefilled or decoded. (A query's row in its tile does vary with the batch: that
takes a ``tl.dot`` whose rows do not depend on their place in the tile, as a GPU's do, and as
interpreter.py makes the interpreter's, which is the host BLAS's otherwise.)

Attention sinks (gpt-oss: a logit per head in the softmax's denominator, weighing no value) fold
into a query's state after its last split, in both paths alike, as one more state: (sink, 1, 0).

Grid cells come from the group's padded ``[S_g, max_q]`` grid: a padding cell has position 0
and repeats a real token, so a cell ``j`` is real when ``j == 0`` or its position is above 0.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl

from tokenmill_service.worker.kernels.attention_metadata import AttentionGroup, AttentionMetadata
from tokenmill_service.worker.kernels.attention_params import AttentionParams
from tokenmill_service.worker.kernels.triton.paged_tiles import SPLIT_KEYS, check_split_keys, key_tile, tile_rows
from tokenmill_service.worker.kernels.triton.softmax_state import combine, empty_state, finish, online_softmax_step

# @triton.jit is untyped, and the kernels' parameters stay unannotated (triton reads a parameter's
# annotation to choose how it specialises the kernel), hence their narrow type-ignores.

BLOCK_N = 64  # keys per tile inside a split
MIN_ROWS = 16  # a tile's query rows; tl.dot needs at least 16 on a GPU
NO_WINDOW = 1 << 30  # the window of a global layer: beyond any position


@triton.jit  # type: ignore[untyped-decorator]
def _split_partial(  # type: ignore[no-untyped-def]
    q, pos, lo, hi, scale, window, softcap,
    k_cache_ptr, v_cache_ptr, table_ptr, kv_head,
    stride_cb, stride_co, stride_ch,
    head_dim,
    BLOCK_M: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr,
):  # fmt: skip
    """Softmax state of rows q [BLOCK_M, D_PAD] (positions pos) over keys lo..hi-1, from scratch:
    a row sees the keys at most its position and above its position - window; with ``SOFTCAP``,
    its scores s become tanh(s / softcap) * softcap."""
    d = tl.arange(0, D_PAD)
    m, l, acc = empty_state(BLOCK_M, D_PAD)
    for start in range(lo, hi, BLOCK_N):
        keys, in_range, block, slot = key_tile(table_ptr, start, hi, BLOCK_SIZE, BLOCK_N)
        offset = block * stride_cb + slot * stride_co + kv_head * stride_ch
        kv_mask = in_range[:, None] & (d < head_dim)[None, :]
        k = tl.load(k_cache_ptr + offset[:, None] + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        v = tl.load(v_cache_ptr + offset[:, None] + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        if SOFTCAP:
            x = scores / softcap
            e = tl.exp(-2.0 * tl.abs(x))  # tanh from exp (triton has no tanh): odd, no overflow
            t = (1.0 - e) / (1.0 + e)
            scores = tl.where(x < 0, -t, t) * softcap
        visible = in_range[None, :] & (keys[None, :] <= pos[:, None]) & (keys[None, :] > pos[:, None] - window)
        m, l, acc = online_softmax_step(m, l, acc, tl.where(visible, scores, float("-inf")), v)
    return m, l, acc


@triton.jit  # type: ignore[untyped-decorator]
def _fold_sink(m_run, l_run, acc_run, sinks_ptr, head, mask, ROWS: tl.constexpr, D_PAD: tl.constexpr):  # type: ignore[no-untyped-def]
    """Fold each row's head's sink logit into its state: a key whose exponential joins the
    denominator and whose value is zero."""
    sink = tl.load(sinks_ptr + head, mask=mask, other=float("-inf")).to(tl.float32)
    ones = tl.full([ROWS], 1.0, tl.float32)
    zeros = tl.zeros([ROWS, D_PAD], tl.float32)
    return combine(m_run, l_run, acc_run, sink, ones, zeros)


@triton.jit  # type: ignore[untyped-decorator]
def _every_split(  # type: ignore[no-untyped-def]
    q, pos, first_visible, keys_end, scale, window, softcap, k_cache_ptr, v_cache_ptr, table_ptr, kv_head,
    stride_cb, stride_co, stride_ch, head_dim,
    BLOCK_M: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, SOFTCAP: tl.constexpr,
):  # fmt: skip
    """One program's whole pass: every split from the first visible one, combined in order."""
    m_run, l_run, acc_run = empty_state(BLOCK_M, D_PAD)
    for lo in range(first_visible // SPLIT * SPLIT, keys_end, SPLIT):
        m, l, acc = _split_partial(
            q, pos, lo, tl.minimum(lo + SPLIT, keys_end), scale, window, softcap, k_cache_ptr, v_cache_ptr,
            table_ptr, kv_head, stride_cb, stride_co, stride_ch, head_dim, BLOCK_M, D_PAD, BLOCK_SIZE, BLOCK_N,
            SOFTCAP,
        )  # fmt: skip
        m_run, l_run, acc_run = combine(m_run, l_run, acc_run, m, l, acc)
    return m_run, l_run, acc_run


@triton.jit  # type: ignore[untyped-decorator]
def _attention_kernel(  # type: ignore[no-untyped-def]
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_acc_ptr, part_ml_ptr, sinks_ptr,
    token_index_ptr, positions_ptr, block_ids_ptr,
    scale, window, softcap,
    max_q, num_q_tiles, table_width, num_heads, num_splits, head_dim,
    stride_qt, stride_qh,
    stride_ot, stride_oh,
    stride_cb, stride_co, stride_ch,
    G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    TWO_STAGE: tl.constexpr, SOFTCAP: tl.constexpr, SINKS: tl.constexpr,
):  # fmt: skip
    BLOCK_M: tl.constexpr = BLOCK_Q * G_PAD
    seq = tl.program_id(0) // num_q_tiles
    kv_head = tl.program_id(1)
    cell, token, pos, real, head = tile_rows(
        token_index_ptr, positions_ptr, seq, tl.program_id(0) % num_q_tiles, kv_head, max_q, G, G_PAD, BLOCK_Q, BLOCK_M
    )
    d = tl.arange(0, D_PAD)
    d_ok = (d < head_dim)[None, :]
    q_off = token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_off, mask=real[:, None] & d_ok, other=0.0).to(tl.float32)
    keys_end = tl.max(pos, axis=0) + 1
    # The splits wholly below every row's window add exact zeros: they are skipped (left empty).
    first_visible = tl.maximum(tl.min(tl.where(real, pos, keys_end), axis=0) - window + 1, 0)
    table_ptr = block_ids_ptr + seq.to(tl.int64) * table_width
    if TWO_STAGE:
        split = tl.program_id(2)
        lo = split * SPLIT
        hi = tl.where(lo + SPLIT <= first_visible, lo, tl.minimum(lo + SPLIT, keys_end))
        m, l, acc = _split_partial(
            q, pos, lo, hi, scale, window, softcap, k_cache_ptr, v_cache_ptr, table_ptr, kv_head,
            stride_cb, stride_co, stride_ch, head_dim, BLOCK_M, D_PAD, BLOCK_SIZE, BLOCK_N, SOFTCAP,
        )  # fmt: skip
        part = (cell * num_heads + head) * num_splits + split
        tl.store(part_ml_ptr + 2 * part, m, mask=real)
        tl.store(part_ml_ptr + 2 * part + 1, l, mask=real)
        tl.store(part_acc_ptr + part[:, None] * head_dim + d[None, :], acc, mask=real[:, None] & d_ok)
    else:
        m_run, l_run, acc_run = _every_split(
            q, pos, first_visible, keys_end, scale, window, softcap, k_cache_ptr, v_cache_ptr, table_ptr, kv_head,
            stride_cb, stride_co, stride_ch, head_dim, BLOCK_M, D_PAD, BLOCK_SIZE, BLOCK_N, SPLIT, SOFTCAP,
        )  # fmt: skip
        if SINKS:
            m_run, l_run, acc_run = _fold_sink(m_run, l_run, acc_run, sinks_ptr, head, real, BLOCK_M, D_PAD)
        out = finish(l_run, acc_run)
        o_off = token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=real[:, None] & d_ok)


@triton.jit  # type: ignore[untyped-decorator]
def _reduce_splits_kernel(  # type: ignore[no-untyped-def]
    out_ptr, part_acc_ptr, part_ml_ptr, sinks_ptr, token_index_ptr,
    num_heads, num_splits, head_dim,
    stride_ot, stride_oh,
    G: tl.constexpr, G_PAD: tl.constexpr, D_PAD: tl.constexpr, SINKS: tl.constexpr,
):  # fmt: skip
    """Second pass of decode: fold each query's split states in split order, as the one-pass path does.

    Runs for decode groups only (one query per sequence), so every grid cell is a real query."""
    cell = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    token = tl.load(token_index_ptr + cell)
    g = tl.arange(0, G_PAD)
    real = g < G
    head = kv_head * G + g
    d = tl.arange(0, D_PAD)
    d_ok = (d < head_dim)[None, :]
    m_run, l_run, acc_run = empty_state(G_PAD, D_PAD)
    for split in range(num_splits):
        part = (cell * num_heads + head) * num_splits + split
        m = tl.load(part_ml_ptr + 2 * part, mask=real, other=float("-inf"))
        l = tl.load(part_ml_ptr + 2 * part + 1, mask=real, other=0.0)
        acc = tl.load(part_acc_ptr + part[:, None] * head_dim + d[None, :], mask=real[:, None] & d_ok, other=0.0)
        m_run, l_run, acc_run = combine(m_run, l_run, acc_run, m, l, acc)
    if SINKS:
        m_run, l_run, acc_run = _fold_sink(m_run, l_run, acc_run, sinks_ptr, head, real, G_PAD, D_PAD)
    out = finish(l_run, acc_run)
    o_off = token * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=real[:, None] & d_ok)


def _group_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: AttentionGroup,
    params: AttentionParams,
    out: torch.Tensor,
    split_keys: int,
) -> None:
    window, softcap, sinks = params.window, params.softcap, params.sinks
    num_seqs, max_q = group.token_index.shape
    _, block_size, kv_heads, head_dim = k_cache.shape
    num_heads = q.shape[1]
    g = num_heads // kv_heads
    g_pad = triton.next_power_of_2(g)
    block_q = max(1, MIN_ROWS // g_pad)
    num_q_tiles = triton.cdiv(max_q, block_q)
    table_width = group.block_ids.shape[1]
    # Every query position lies below the table's reach, so this bounds the splits without a host sync.
    num_splits = triton.cdiv(table_width * block_size, split_keys)
    two_stage = max_q == 1 and num_splits > 1
    cells = num_seqs * max_q
    if two_stage:
        part_acc = torch.empty((cells, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((cells, num_heads, num_splits, 2), dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # not read without TWO_STAGE
    sinks_arg = out if sinks is None else sinks  # not read without SINKS
    grid = (num_seqs * num_q_tiles, kv_heads, num_splits if two_stage else 1)
    _attention_kernel[grid](
        q, k_cache, v_cache, out, part_acc, part_ml, sinks_arg,
        group.token_index, group.query_positions, group.block_ids,
        params.scale, NO_WINDOW if window is None else window, softcap or 1.0, max_q, num_q_tiles, table_width, num_heads, num_splits, head_dim,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        G=g, G_PAD=g_pad, BLOCK_Q=block_q, D_PAD=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size, BLOCK_N=min(BLOCK_N, split_keys), SPLIT=split_keys, TWO_STAGE=two_stage,
        SOFTCAP=softcap is not None, SINKS=sinks is not None,
    )  # fmt: skip
    if two_stage:
        _reduce_splits_kernel[(cells, kv_heads)](
            out, part_acc, part_ml, sinks_arg, group.token_index, num_heads, num_splits, head_dim, out.stride(0),
            out.stride(1), G=g, G_PAD=g_pad, D_PAD=max(16, triton.next_power_of_2(head_dim)), SINKS=sinks is not None,
        )  # fmt: skip


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    params: AttentionParams,
    split_keys: int = SPLIT_KEYS,
) -> torch.Tensor:
    """As ``Ops.attention``: q [T, H, D] -> [T, H, D] in q's dtype; caches [blocks, block_size, KV, D]."""
    check_split_keys(split_keys)
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("the triton attention kernel needs q and the caches contiguous in their last dim")
    out = torch.empty_like(q)
    if params.sinks is not None:
        params = replace(params, sinks=params.sinks.float().contiguous())
    for group in meta.groups:
        _group_attention(q, k_cache, v_cache, group, params, out, split_keys)
    return out
