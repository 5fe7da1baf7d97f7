"""Reference attention over a paged KV cache, in plain torch (runs on CPU and GPU).

Cache layout, per layer: ``[num_blocks, block_size, num_kv_heads, head_dim]`` for keys and
the same for values. A token's flat slot is ``block * block_size + offset``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill_service.models.attention_metadata import AttentionMetadata


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """Write this step's keys and values ([T, kv_heads, head_dim]) into their cache slots."""
    kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slots, k)
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slots, v)


def _gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` cached tokens of one sequence, as [length, kv_heads, head_dim]."""
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    blocks = cache.index_select(0, block_table[:num_blocks])
    return blocks.flatten(0, 1)[:length]


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [Tq, H, D]; k, v: [Tk, KV, D] with Tk >= Tq; the queries are the last Tq positions."""
    tq, num_heads, _ = q.shape
    tk, kv_heads, _ = k.shape
    group = num_heads // kv_heads
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    if tq == tk:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
    else:
        # Query i sits at absolute position tk - tq + i and sees keys 0..that position.
        q_pos = torch.arange(tk - tq, tk, device=q.device)
        mask = torch.arange(tk, device=q.device)[None, :] <= q_pos[:, None]
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
    return out.transpose(0, 1)


def _batched_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence, all sequences in one call. q: [B, H, D] -> [B, H, D]."""
    batch, num_heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // kv_heads
    max_len = int(context_lens.max().item())
    max_blocks = (max_len + block_size - 1) // block_size
    tables = block_tables[:, :max_blocks]
    # [B, blocks, block_size, KV, D] -> [B, KV, L, D]
    k = k_cache[tables].flatten(1, 2)[:, :max_len].transpose(1, 2)
    v = v_cache[tables].flatten(1, 2)[:, :max_len].transpose(1, 2)
    # Grouped-query attention without repeating K/V: the heads of a group become the query axis.
    qg = q.view(batch, kv_heads, group, head_dim)
    valid = torch.arange(max_len, device=q.device)[None, :] < context_lens[:, None]
    mask = valid[:, None, None, :]  # [B, 1, 1, L]
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)
    return out.reshape(batch, num_heads, head_dim)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor | None,
    v_cache: torch.Tensor | None,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Attention for a flat batch: q [T, H, D], k and v [T, KV, D] for this step's tokens."""
    if k_cache is None or v_cache is None or meta.slot_mapping is None:
        outs, start = [], 0
        for n in meta.query_lens:
            outs.append(_causal_attention(q[start : start + n], k[start : start + n], v[start : start + n], scale))
            start += n
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    assert meta.block_tables is not None and meta.context_lens_tensor is not None
    if meta.is_decode_only:
        return _batched_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens_tensor, scale)

    # A mixed step (prefill chunks beside decodes): the decodes still go through one batched
    # call, each prefill chunk attends on its own.
    out = torch.empty_like(q)
    starts = [0]
    for n in meta.query_lens:
        starts.append(starts[-1] + n)
    decodes = [i for i, n in enumerate(meta.query_lens) if n == 1]
    if decodes:
        seq_idx = torch.tensor(decodes, dtype=torch.long, device=q.device)
        tok_idx = torch.tensor([starts[i] for i in decodes], dtype=torch.long, device=q.device)
        out[tok_idx] = _batched_decode_attention(
            q[tok_idx], k_cache, v_cache, meta.block_tables[seq_idx], meta.context_lens_tensor[seq_idx], scale
        )
    for i, (n, ctx) in enumerate(zip(meta.query_lens, meta.context_lens)):
        if n == 1:
            continue
        kc = _gather_context(k_cache, meta.block_tables[i], ctx)
        vc = _gather_context(v_cache, meta.block_tables[i], ctx)
        out[starts[i] : starts[i + 1]] = _causal_attention(q[starts[i] : starts[i + 1]], kc, vc, scale)
    return out
