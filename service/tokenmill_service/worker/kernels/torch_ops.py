"""The reference implementation of the hot operations, in plain torch (CPU and GPU).

Attention is written so that a query's result is bit-for-bit the same whatever else is in the
batch and whether it arrives in a prefill chunk or as a decode token:

- keys are visited in chunks at fixed absolute positions (``KEY_CHUNK``), with an online
  softmax across chunks; a chunk with no visible key leaves the running state unchanged (so the
  chunks wholly before every query's sliding window are skipped, and soft-capping is elementwise);
  attention sinks fold into that state once, after the last chunk, as one more key of value zero;
- within a chunk, the only reductions are matrix products and ``amax`` (exact in any order); the
  softmax denominator is one more column of the ``p @ v`` product rather than a ``sum`` (whose
  vectorized order changes with the row length);
- those products have shapes the batch does not choose: every chunk is a whole ``KEY_CHUNK`` of keys
  (the tail masked), the operands are contiguous, and each (sequence, kv head) holds its query rows
  padded to a multiple of ``ROW_MULTIPLE`` and multiplied ``ROW_MULTIPLE`` rows at a time, each such
  slice one item of a batched product (``row_slices_matmul``). MKL picks its kernel by a product's
  shape, and a kernel for 4 rows can sum in another order than one for 320 (an Intel Xeon with
  AVX-512 does, for 128 columns of keys): so every row's sums come from the same 4-row product,
  whatever the batch and the prefill. That the items of a batched product do not depend on how many
  there are is a measured property of that library (as for the linear layers, README.md), which
  tests/kernels/test_torch_ops.py holds to account.

tests/kernels/test_paged_attention.py (in process, per model configuration) and tests/service/test_batching_service.py
(through the RPC) hold these properties to account.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from tokenmill_service.worker.kernels.attention_metadata import KEY_CHUNK, AttentionGroup, AttentionMetadata
from tokenmill_service.worker.kernels.attention_params import AttentionParams, LatentAttentionParams, LatentCache
from tokenmill_service.worker.kernels.interface import LatentCacheLayout, Ops, register_ops

# The query rows of each (sequence, kv head) product are padded to a multiple of this (see below).
ROW_MULTIPLE = 4


def rotate_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def _first_chunk(group: AttentionGroup, window: int | None) -> int:
    """The first key chunk any of the group's queries sees: 0, or past the chunks that lie wholly
    before every query's window (skipping them is exact: such a chunk leaves a query's state as it is)."""
    if window is None:
        return 0
    lowest = int(group.query_positions.view(-1).index_select(0, group.valid_cells).min())
    return max(0, lowest - window + 1) // KEY_CHUNK


def row_slices_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for a [S, H, rows, K] (rows a multiple of ROW_MULTIPLE) and b [S, H, K, N], or [H, K, N] shared by
    every sequence (a weight), all contiguous: each ROW_MULTIPLE rows of a (sequence, head) as one item of a batched
    product, so every row is summed by the same kernel whether it is one of 4 rows or of 2048."""
    seqs, heads, rows, inner = a.shape
    cols, slices, pairs = b.shape[-1], rows // ROW_MULTIPLE, seqs * heads
    out = a.new_empty(seqs, heads, rows, cols)
    if b.dim() == 3:  # a weight per head: one batch of every sequence's slices per head, b expanded, not copied
        for h in range(heads):
            items = a[:, h].reshape(seqs * slices, ROW_MULTIPLE, inner)
            out[:, h] = torch.bmm(items, b[h].expand(seqs * slices, inner, cols)).view(seqs, rows, cols)
        return out
    if slices == 1:
        return torch.bmm(a.view(pairs, rows, inner), b.view(pairs, inner, cols)).view(seqs, heads, rows, cols)
    if slices <= pairs:  # a few slices of many sequences: one batch of every pair per slice
        for c in range(slices):
            part = slice(c * ROW_MULTIPLE, (c + 1) * ROW_MULTIPLE)
            items = a[:, :, part].reshape(pairs, ROW_MULTIPLE, inner)
            out[:, :, part] = torch.bmm(items, b.view(pairs, inner, cols)).view(seqs, heads, ROW_MULTIPLE, cols)
        return out
    for s in range(seqs):  # a prefill: one batch of its slices per pair, b shared (expanded, not copied)
        for h in range(heads):
            shared = b[s, h].expand(slices, inner, cols)
            torch.bmm(a[s, h].view(slices, ROW_MULTIPLE, inner), shared, out=out[s, h].view(slices, ROW_MULTIPLE, cols))
    return out


def _group_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: AttentionGroup, params: AttentionParams
) -> torch.Tensor:
    """Attention for one group's queries: [n_valid, H, D] float32, rows in ``group.valid_rows`` order."""
    scale, window, softcap, sinks = params.scale, params.window, params.softcap, params.sinks
    num_seqs, max_q = group.token_index.shape
    _, block_size, kv_heads, head_dim = k_cache.shape
    num_heads = q.shape[1]
    g = num_heads // kv_heads
    # [S, Q, KV, G, D] -> [S, KV, G * Q, D]: one matrix product per (sequence, kv head).
    qg = q.float()[group.token_index].view(num_seqs, max_q, kv_heads, g, head_dim)
    qg = qg.permute(0, 2, 3, 1, 4).reshape(num_seqs, kv_heads, g * max_q, head_dim).contiguous()
    rows = g * max_q
    # Zero rows up to a multiple of ROW_MULTIPLE: one row takes another kernel (gemv), and MKL's batched
    # products of 1-3 or 5-11 rows group neighbouring sequences, so a row's sums follow its neighbours.
    if rows % ROW_MULTIPLE:
        pad = ROW_MULTIPLE - rows % ROW_MULTIPLE
        qg = torch.cat((qg, qg.new_zeros(num_seqs, kv_heads, pad, head_dim)), dim=2)
    m = torch.full((num_seqs, kv_heads, qg.shape[2], 1), float("-inf"), device=q.device)
    acc = torch.zeros((num_seqs, kv_heads, qg.shape[2], head_dim + 1), device=q.device)
    blocks_per_chunk = KEY_CHUNK // block_size
    length = KEY_CHUNK
    # A sliding window hides the keys at or below position - window, for each query its own.
    oldest = None if window is None else (group.query_positions - window)[:, None, :, None]
    for c in range(_first_chunk(group, window), len(group.chunk_masks)):
        invisible = group.chunk_masks[c]
        if oldest is not None:
            keys = torch.arange(c * KEY_CHUNK, c * KEY_CHUNK + invisible.shape[-1], device=q.device)
            invisible = invisible | (keys <= oldest)
        blocks = group.block_ids[:, c * blocks_per_chunk : (c + 1) * blocks_per_chunk]
        if blocks.shape[1] < blocks_per_chunk:
            # Every chunk is a whole KEY_CHUNK of keys (the tail masked): the products' shapes, and so
            # their summation orders, must not follow the longest context in the batch.
            pad = blocks_per_chunk - blocks.shape[1]
            blocks = torch.cat((blocks, blocks.new_zeros(num_seqs, pad)), dim=1)
            hidden = invisible.new_ones(*invisible.shape[:-1], pad * block_size)
            invisible = torch.cat((invisible, hidden), dim=-1)
        # index_select gathers whole blocks two to three times faster than advanced indexing.
        flat = blocks.reshape(-1)
        # k as [S, KV, D, length], contiguous: one layout for every batch (a strided one is viewed by
        # bmm for some shapes and copied for others, two paths that sum in different orders).
        k_t = k_cache.index_select(0, flat).view(num_seqs, length, kv_heads, head_dim).permute(0, 2, 3, 1)
        k_t = k_t.float().contiguous()
        v = v_cache.index_select(0, flat).view(num_seqs, length, kv_heads, head_dim).transpose(1, 2).float()
        ones = torch.ones((num_seqs, kv_heads, length, 1), device=q.device)
        v1 = torch.cat((v, ones), dim=-1)  # the last column of p @ v1 is the softmax denominator
        scores = row_slices_matmul(qg, k_t) * scale  # [S, KV, rows, length]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        s = scores[:, :, :rows].view(num_seqs, kv_heads, g, max_q, length)
        s.masked_fill_(invisible[:, :, None], float("-inf"))
        m_new = torch.maximum(m, scores.amax(dim=-1, keepdim=True))
        # A row that has seen no key yet (only behind a window): its state stays exactly zero.
        m_safe = m_new if oldest is None else torch.where(m_new == float("-inf"), 0.0, m_new)
        p = torch.exp(scores - m_safe)
        acc = acc * torch.exp(m - m_safe) + row_slices_matmul(p, v1)
        m = m_new
    if sinks is not None:
        # One more logit per head, weighing no value. With (a, b) = softmax((m, sink)), the row's
        # numerator times a over its denominator times a plus b is the softmax with the sink; a
        # softmax over rows of two computes each row on its own (an exp over the flat [rows] would
        # take its last elements down a scalar path whose bits differ, and the rows vary by step).
        sink = sinks.float().view(1, kv_heads, g, 1, 1).expand(num_seqs, kv_heads, g, max_q, 1)
        sink = torch.cat((sink.reshape(num_seqs, kv_heads, rows, 1), m[:, :, rows:]), dim=2)  # pad rows: inert
        weights = torch.softmax(torch.cat((m, sink), dim=-1), dim=-1)
        acc = acc * weights[..., :1]
        acc[..., head_dim:] += weights[..., 1:]
    out = acc[:, :, :rows, :head_dim] / acc[:, :, :rows, head_dim:]
    # [S, KV, G, Q, D] -> [S * Q, H, D], then the real queries only.
    out = out.view(num_seqs, kv_heads, g, max_q, head_dim).permute(0, 3, 1, 2, 4).reshape(-1, num_heads, head_dim)
    return out.index_select(0, group.valid_cells)


@register_ops("torch")
class TorchOps(Ops):
    compilable = True
    latent_cache_layout = LatentCacheLayout()

    def rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None,
        out_dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h = x.float() if residual is None else residual + x.float()
        normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return (normed * weight).to(out_dtype), h

    def rotary(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
        return rotate_halves(q, c, s), rotate_halves(k, c, s)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.float().chunk(2, dim=-1)
        return (F.silu(gate) * up).to(x.dtype)

    def store_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
        v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))

    def attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        params: AttentionParams,
    ) -> torch.Tensor:
        return _scatter(q, [(g, _group_attention(q, k_cache, v_cache, g, params)) for g in meta.groups])

    def store_latent(
        self, latent: torch.Tensor, k_rope: torch.Tensor, cache: LatentCache, slot_mapping: torch.Tensor
    ) -> None:
        from tokenmill_service.worker.kernels import latent_attention

        latent_attention.store_latent(latent, k_rope, cache, slot_mapping)

    def latent_attention(
        self,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        cache: LatentCache,
        meta: AttentionMetadata,
        params: LatentAttentionParams,
    ) -> torch.Tensor:
        from tokenmill_service.worker.kernels.latent_attention import group_latent_attention

        # Contiguous for the products (views of kv_b_proj's weight take other, batch-dependent paths).
        params = replace(params, w_uk=params.w_uk.contiguous(), w_uv=params.w_uv.contiguous())
        out = torch.empty(*q_nope.shape[:2], params.w_uv.shape[-1], dtype=q_nope.dtype, device=q_nope.device)
        for g in meta.groups:
            rows = group_latent_attention(q_nope, q_rope, cache, g, params)
            out.index_copy_(0, g.valid_rows, rows.to(out.dtype))
        return out


def _scatter(q: torch.Tensor, parts: list[tuple[AttentionGroup, torch.Tensor]]) -> torch.Tensor:
    out = torch.empty_like(q)
    for group, rows in parts:
        out.index_copy_(0, group.valid_rows, rows.to(q.dtype))
    return out
