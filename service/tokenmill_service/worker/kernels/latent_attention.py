"""Multi-head latent attention (DeepSeek-V2/V3's MLA) over the latent cache, in plain torch: the reference.

A token caches one latent ``c`` [L] (shared by every head) and one rotary key ``k_rope`` [R]
(``LatentCacheLayout``). Head h's key at position j is ``[c_j @ W_uk[h].T, k_rope_j]`` and its value
``c_j @ W_uv[h]``; this computes attention in the *absorbed* form, never expanding a key or a value:

    q_lat = q_nope @ W_uk[h]                       [L]   (the key up-projection folded into the query)
    s_j   = (q_lat . c_j + q_rope . k_rope_j) * scale
    out   = (sum_j softmax(s)_j c_j) @ W_uv[h]     [V]   (the value up-projection applied after)

Prefill chunks and decode tokens take this same path (there is no expanded prefill form), so a
query's result cannot depend on which one its position arrived in, and it keeps the reference
attention's rules for batch invariance (worker/kernels/torch_ops.py): keys visited in whole ``KEY_CHUNK``
chunks at fixed absolute positions with an online softmax, the denominator one more column of the
``p @ v`` product, and every matrix product of a shape the batch does not choose: each (sequence,
head) holds its query rows padded to a multiple of ``ROW_MULTIPLE`` and multiplied that many at a time
(``row_slices_matmul``), for the absorption, the scores (all heads of a sequence against its one latent key per
position) and the value up-projection alike.
"""

from __future__ import annotations

import torch

from tokenmill_service.worker.kernels.attention_metadata import KEY_CHUNK, AttentionGroup
from tokenmill_service.worker.kernels.attention_params import LatentAttentionParams, LatentCache
from tokenmill_service.worker.kernels.torch_ops import ROW_MULTIPLE, row_slices_matmul


def store_latent(latent: torch.Tensor, k_rope: torch.Tensor, cache: LatentCache, slot_mapping: torch.Tensor) -> None:
    for rows, stored in ((latent, cache.latents), (k_rope, cache.rope_keys)):
        stored.view(-1, stored.shape[-1]).index_copy_(0, slot_mapping, rows.to(stored.dtype))


def group_latent_attention(
    q_nope: torch.Tensor, q_rope: torch.Tensor, cache: LatentCache, group: AttentionGroup, params: LatentAttentionParams
) -> torch.Tensor:
    """Latent attention for one group's queries: [n_valid, H, V] float32, rows in ``group.valid_rows`` order."""
    latent_cache, rope_cache, w_uk, w_uv, scale = cache.latents, cache.rope_keys, params.w_uk, params.w_uv, params.scale
    num_seqs, max_q = group.token_index.shape
    block_size, latent_dim = latent_cache.shape[1], latent_cache.shape[-1]
    rope_dim = rope_cache.shape[-1]
    heads, v_dim = w_uv.shape[0], w_uv.shape[-1]
    rows = -(-max_q // ROW_MULTIPLE) * ROW_MULTIPLE  # each (sequence, head)'s query rows, zero-padded

    def grid(x: torch.Tensor) -> torch.Tensor:
        """[T, H, D] -> [S, H, rows, D]: each sequence's queries per head, padded with zero rows."""
        g = x.float()[group.token_index].permute(0, 2, 1, 3)
        if rows > max_q:
            g = torch.cat((g, g.new_zeros(num_seqs, heads, rows - max_q, x.shape[-1])), dim=2)
        return g.contiguous()

    q_latent = row_slices_matmul(grid(q_nope), w_uk)  # [S, H, rows, L]: the absorbed key projection
    # All heads' rows against the sequence's one key per position: [S, 1, H * rows, L + R].
    q = torch.cat((q_latent, grid(q_rope)), dim=-1).view(num_seqs, 1, heads * rows, latent_dim + rope_dim)
    m = torch.full((num_seqs, 1, heads * rows, 1), float("-inf"), device=q.device)
    acc = torch.zeros((num_seqs, 1, heads * rows, latent_dim + 1), device=q.device)
    blocks_per_chunk = KEY_CHUNK // block_size
    length = KEY_CHUNK
    ones = torch.ones((num_seqs, 1, length, 1), device=q.device)
    for c, invisible in enumerate(group.chunk_masks):
        blocks = group.block_ids[:, c * blocks_per_chunk : (c + 1) * blocks_per_chunk]
        if blocks.shape[1] < blocks_per_chunk:  # a whole chunk of keys, the tail masked (as torch_ops.py)
            pad = blocks_per_chunk - blocks.shape[1]
            blocks = torch.cat((blocks, blocks.new_zeros(num_seqs, pad)), dim=1)
            invisible = torch.cat((invisible, invisible.new_ones(*invisible.shape[:-1], pad * block_size)), dim=-1)
        flat = blocks.reshape(-1)
        latent = latent_cache.index_select(0, flat).view(num_seqs, 1, length, latent_dim).float()
        k_rope = rope_cache.index_select(0, flat).view(num_seqs, 1, length, rope_dim).float()
        keys_t = torch.cat((latent, k_rope), dim=-1).transpose(-1, -2).contiguous()  # [S, 1, L + R, length]
        values = torch.cat((latent, ones), dim=-1)  # the last column of p @ values is the denominator
        scores = row_slices_matmul(q, keys_t) * scale  # [S, 1, H * rows, length]
        s = scores.view(num_seqs, heads, rows, length)[:, :, :max_q]
        s.masked_fill_(invisible, float("-inf"))  # [S, 1, max_q, length] over every head
        m_new = torch.maximum(m, scores.amax(dim=-1, keepdim=True))
        p = torch.exp(scores - m_new)
        acc = acc * torch.exp(m - m_new) + row_slices_matmul(p, values)
        m = m_new
    out_latent = (acc[..., :latent_dim] / acc[..., latent_dim:]).view(num_seqs, heads, rows, latent_dim)
    out = row_slices_matmul(out_latent.contiguous(), w_uv)[:, :, :max_q]  # [S, H, max_q, V]: the value up-projection
    out = out.permute(0, 2, 1, 3).reshape(-1, heads, v_dim)
    return out.index_select(0, group.valid_cells)
