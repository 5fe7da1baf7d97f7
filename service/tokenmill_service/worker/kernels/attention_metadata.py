"""Per-step attention metadata: tensors built once per step by the runner, read by every layer.

The model never sees requests. A step runs a flat batch of ``T`` new tokens from ``S`` sequences
(prefill chunks and single decode tokens side by side). Attention runs in *groups*: the decode
tokens in one, the prefill chunks in another, each laid out as a padded ``[S_g, max_q]`` grid of
query rows, so that no layer loops over sequences and no layer reads a Python list or syncs
with the host. The groups are built when first read (by the first layer's attention, for all
layers): the native kernel reads the flat per-token view instead and never pays for them. Keys are visited in fixed chunks of ``KEY_CHUNK`` absolute positions, the same
chunks whichever group a query sits in: that is what makes a query's result independent of
the batch and of whether its prefix was prefilled or decoded (see worker/kernels/torch_ops.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

# Keys per chunk of the attention loop; a multiple of every KV block size we allow (16 by default).
KEY_CHUNK = 256
# A block table slot whose block is gone: freed once every layer's sliding window had left it behind
# (worker/engine/block_manager.py). It is read as block 0, as padding is: only keys before every query's
# window lie there, which every kernel masks (weight exactly 0, whatever finite values the block holds).
NULL_BLOCK = -1


@dataclass(slots=True)
class AttentionGroup:
    """Sequences whose queries run through attention together ([S_g, max_q] padded grid)."""

    # Row of the flat batch for each grid cell, [S_g, max_q] int64; padding cells repeat a valid row.
    token_index: torch.Tensor
    # Absolute position of each grid cell's query, [S_g, max_q] int64 (padding: 0).
    query_positions: torch.Tensor
    # KV cache block ids of each sequence, [S_g, num_chunks * blocks_per_chunk] int64, padded with 0.
    block_ids: torch.Tensor
    # Grid cells that hold a real query (flat index into S_g * max_q) and their rows in the batch.
    valid_cells: torch.Tensor
    valid_rows: torch.Tensor
    # Per key chunk: which keys each query may see, [S_g, 1, max_q, KEY_CHUNK] bool (causal + length).
    chunk_masks: list[torch.Tensor]
    max_query_len: int


@dataclass(slots=True)
class AttentionMetadata:
    # Cache slot (block * block_size + offset) of each new token, [T] int64.
    slot_mapping: torch.Tensor
    num_tokens: int
    # The KV cache of every layer, in the ops backend's layout (worker/kernels/interface.py: KVCacheLayout).
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_size: int
    # Flat per-token view, for kernels that take each query on its own (worker/kernels/cpu/paged_attention.py):
    # the absolute position [T] and sequence [T] of each new token, and every sequence's block
    # table, [S, max blocks] int64 padded with 0.
    positions: torch.Tensor
    seq_of_token: torch.Tensor
    block_tables: torch.Tensor
    # Builds the groups (below) the first time they are read: kernels that take each query on its
    # own from the flat view (worker/kernels/cpu/paged_attention.py) never read them, nor build their masks.
    build_groups: Callable[[], list[AttentionGroup]]
    extra: dict[str, object] = field(default_factory=dict)  # backend-specific additions
    _groups: list[AttentionGroup] | None = None
    # KV-cache groups (worker/engine/kv_cache_groups.py): per layer, the metadata of its group (its block
    # tables and slots) and its storage tensor in the caches. None: one group, layer i in tensor i.
    layer_kv: list[tuple[AttentionMetadata, int]] | None = None

    def for_layer(self, layer: int) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor]:
        """What layer ``layer`` attends with: its group's metadata, and its key and value cache."""
        if self.layer_kv is None:
            return self, self.k_cache[layer], self.v_cache[layer]
        meta, index = self.layer_kv[layer]
        return meta, meta.k_cache[index], meta.v_cache[index]

    @property
    def groups(self) -> list[AttentionGroup]:
        """The decode group and/or the prefill group (one or two entries), built once per step."""
        if self._groups is None:
            self._groups = self.build_groups()
        return self._groups


def _group(
    seqs: list[int],
    query_lens: list[int],
    starts: list[int],
    offsets: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
) -> AttentionGroup:
    max_q = max(query_lens[i] for i in seqs)
    max_ctx = max(starts[i] + query_lens[i] for i in seqs)
    num_blocks = -(-max_ctx // block_size)
    token_index: list[list[int]] = []
    query_pos: list[list[int]] = []
    valid_cells: list[int] = []
    valid_rows: list[int] = []
    blocks: list[list[int]] = []
    for row, i in enumerate(seqs):
        n, start, offset = query_lens[i], starts[i], offsets[i]
        token_index.append([offset + min(j, n - 1) for j in range(max_q)])
        query_pos.append([start + j if j < n else 0 for j in range(max_q)])
        valid_cells.extend(row * max_q + j for j in range(n))
        valid_rows.extend(range(offset, offset + n))
        table = block_tables[i][:num_blocks]
        blocks.append(table + [0] * (num_blocks - len(table)))

    def t(x: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.long, device=device)

    positions = t(query_pos)
    masks = []
    for chunk_start in range(0, num_blocks * block_size, KEY_CHUNK):
        length = min(KEY_CHUNK, num_blocks * block_size - chunk_start)
        keys = torch.arange(chunk_start, chunk_start + length, device=device)
        masks.append((keys[None, None, :] > positions[:, :, None]).unsqueeze(1))
    return AttentionGroup(
        token_index=t(token_index),
        query_positions=positions,
        block_ids=t(blocks).clamp_(min=0),  # NULL_BLOCK reads block 0
        valid_cells=t(valid_cells),
        valid_rows=t(valid_rows),
        chunk_masks=masks,
        max_query_len=max_q,
    )


def build_attention_metadata(
    query_lens: list[int],
    starts: list[int],
    block_tables: list[list[int]],
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> AttentionMetadata:
    """Metadata for a step: sequence i adds ``query_lens[i]`` tokens at positions ``starts[i]`` onwards
    (its earlier tokens are cached), its blocks are ``block_tables[i]``; caches as in AttentionMetadata."""
    device = k_cache.device
    block_size = v_cache.shape[2]  # values are [layers, blocks, block_size, ...] in every layout
    if KEY_CHUNK % block_size:
        raise ValueError(f"the KV block size ({block_size}) must divide {KEY_CHUNK}")
    offsets: list[int] = []
    slots: list[int] = []
    positions: list[int] = []
    seq_of_token: list[int] = []
    total = 0
    for i, (n, start, table) in enumerate(zip(query_lens, starts, block_tables)):
        offsets.append(total)
        total += n
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, start + n))
        positions.extend(range(start, start + n))
        seq_of_token.extend([i] * n)
    # Only the blocks the step's queries can see (a table may hold blocks reserved for later tokens).
    width = max((-(-(s + n) // block_size) for s, n in zip(starts, query_lens)), default=0)
    tables = [table[:width] + [0] * (width - len(table[:width])) for table in block_tables]

    def t(x: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.long, device=device)

    decodes = [i for i, n in enumerate(query_lens) if n == 1]
    prefills = [i for i, n in enumerate(query_lens) if n > 1]

    def build_groups() -> list[AttentionGroup]:
        return [
            _group(seqs, query_lens, starts, offsets, block_tables, block_size, device)
            for seqs in (decodes, prefills)
            if seqs
        ]

    return AttentionMetadata(
        slot_mapping=t(slots),
        num_tokens=total,
        k_cache=k_cache,
        v_cache=v_cache,
        block_size=block_size,
        positions=t(positions),
        seq_of_token=t(seq_of_token),
        block_tables=t(tables).view(len(block_tables), width).clamp_(min=0),  # NULL_BLOCK reads block 0
        build_groups=build_groups,
    )
