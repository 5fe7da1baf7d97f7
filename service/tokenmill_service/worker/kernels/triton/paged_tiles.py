"""Where a program of either paged attention kernel (attention.py, latent_attention.py) finds its query rows
and its keys: ``tile_rows`` reads a tile of rows from a group's padded ``[S_g, max_q]`` grid, ``key_tile`` finds
a tile of keys through a sequence's block table, and both visit the keys in splits of ``SPLIT_KEYS`` absolute
positions. Each jit function is inlined into its caller's kernel, so sharing them changes no arithmetic."""

from __future__ import annotations

import triton
import triton.language as tl

# @triton.jit is untyped, and the kernels' parameters stay unannotated (triton reads a parameter's
# annotation to choose how it specialises the kernel), hence their narrow type-ignores.

SPLIT_KEYS = 256  # keys per split (absolute positions); fixed, so results do not vary with the batch


def check_split_keys(split_keys: int) -> None:
    """A split is a whole number of key tiles, and a tile at least 16 keys (``tl.dot``'s least on a GPU)."""
    if split_keys < 16 or split_keys & (split_keys - 1):
        raise ValueError(f"split_keys must be a power of two of at least 16, not {split_keys}")


@triton.jit  # type: ignore[untyped-decorator]
def tile_rows(  # type: ignore[no-untyped-def]
    token_index_ptr, positions_ptr, seq, q_tile, kv_head, max_q,
    G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    """A program's rows: BLOCK_Q queries of its sequence, each with the G query heads of its kv head (padded
    to G_PAD; G = G_PAD = 1 for one head a row). Returns each row's grid cell, token, position (-1 where the
    row is not a real query), whether it is one, and its query head. A padding cell has position 0 and
    repeats a real token, so a cell ``j`` is real when ``j == 0`` or its position is above 0."""
    r = tl.arange(0, BLOCK_M)
    j = q_tile * BLOCK_Q + r // G_PAD
    g = r % G_PAD
    in_grid = (j < max_q) & (g < G)
    cell = seq.to(tl.int64) * max_q + j
    token = tl.load(token_index_ptr + cell, mask=in_grid, other=0)
    pos = tl.load(positions_ptr + cell, mask=in_grid, other=0)
    real = in_grid & ((j == 0) | (pos > 0))
    return cell, token, tl.where(real, pos, -1), real, kv_head * G + g


@triton.jit  # type: ignore[untyped-decorator]
def key_tile(table_ptr, start, hi, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):  # type: ignore[no-untyped-def]
    """The BLOCK_N keys from position ``start``: their positions, whether each lies below ``hi``, and the cache
    block (through the sequence's block table at ``table_ptr``; 0 out of range) and slot in it of each."""
    keys = start + tl.arange(0, BLOCK_N)
    in_range = keys < hi
    block = tl.load(table_ptr + keys // BLOCK_SIZE, mask=in_range, other=0)
    return keys, in_range, block, keys % BLOCK_SIZE
