"""The batched LoRA product as Triton kernels, grouped by adapter (SGMV, as Punica and S-LoRA run it):
``lora_delta`` with the signature of worker/layers/lora/sgmv.py's (``LoRADelta``), which the layers use under ``--backend triton``.

The step's tokens are taken group by group (one adapter slot each) in tiles of ``BLOCK_M`` rows, so a
tile reads its adapter's A and B once for all its rows. For each projection of the layer (q, k, v of a
packed layer), ``shrink``: mid = x[rows] @ A_p[slot].T into [tokens, R]; ``expand``: its columns of the
delta, mid @ B.T[slot][:, its outputs] into [tokens, its outputs]. Only the rows the slot's adapter fills
(``ranks``) are read. Weights float32 or bfloat16, widened to float32; both accumulate float32 and multiply
at full float32 precision (``input_precision="ieee"``: no TF32 rounding on a GPU).

Batch invariance: a row's delta is a function of that row alone. Every tile has the same shape whatever
the group's size, the reduction over K (or W) runs the same blocks in the same order, and the rows
beside it in a tile (or the masked rows past a group's end, zeros) never enter its sums.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill_service.worker.kernels.interface import LoRAStack

# @triton.jit is untyped, and the kernels' parameters stay unannotated (triton reads a parameter's
# annotation to choose how it specialises the kernel), hence their narrow type-ignores.

BLOCK_M, BLOCK_K, BLOCK_N = 16, 32, 64


@triton.jit  # type: ignore[untyped-decorator]
def _shrink_kernel(  # type: ignore[no-untyped-def]
    x_ptr, a_ptr, mid_ptr, rows_ptr, tile_slot_ptr, tile_start_ptr, tile_count_ptr, ranks_ptr, part, parts,
    K, stride_x, stride_a_slot, stride_a_row, stride_mid,
    BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    slot = tl.load(tile_slot_ptr + tile).to(tl.int64)
    W = tl.load(ranks_ptr + slot * parts + part)  # the rows of A this slot's adapter fills
    start = tl.load(tile_start_ptr + tile).to(tl.int64)
    count = tl.load(tile_count_ptr + tile)
    m = tl.arange(0, BLOCK_M)
    row_mask = m < count
    pos = start + m  # the rows' places in the step's grouped order (mid's rows)
    rows = tl.load(rows_ptr + pos, mask=row_mask, other=0).to(tl.int64)
    w = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    w_mask = w < W
    acc = tl.zeros((BLOCK_M, BLOCK_W), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < K
        xk = tl.load(
            x_ptr + rows[:, None] * stride_x + k[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0
        ).to(tl.float32)
        ak = tl.load(
            a_ptr + slot * stride_a_slot + w[None, :] * stride_a_row + k[:, None],
            mask=k_mask[:, None] & w_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        acc += tl.dot(xk, ak, input_precision="ieee")
    tl.store(mid_ptr + pos[:, None] * stride_mid + w[None, :], acc, mask=row_mask[:, None] & w_mask[None, :])


@triton.jit  # type: ignore[untyped-decorator]
def _expand_kernel(  # type: ignore[no-untyped-def]
    mid_ptr, b_ptr, out_ptr, tile_slot_ptr, tile_start_ptr, tile_count_ptr, ranks_ptr, part, parts,
    N, R, stride_mid, stride_b_slot, stride_b_rank, stride_out,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    slot = tl.load(tile_slot_ptr + tile).to(tl.int64)
    W = tl.load(ranks_ptr + slot * parts + part)
    start = tl.load(tile_start_ptr + tile).to(tl.int64)
    count = tl.load(tile_count_ptr + tile)
    m = tl.arange(0, BLOCK_M)
    row_mask = m < count
    pos = start + m
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for w0 in range(0, R, BLOCK_W):  # (the same blocks for every slot; those past its rank are masked)
        w = w0 + tl.arange(0, BLOCK_W)
        w_mask = w < W
        mk = tl.load(
            mid_ptr + pos[:, None] * stride_mid + w[None, :], mask=row_mask[:, None] & w_mask[None, :], other=0.0
        )
        bk = tl.load(
            b_ptr + slot * stride_b_slot + n[None, :] + w[:, None] * stride_b_rank,
            mask=w_mask[:, None] & n_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        acc += tl.dot(mk, bk, input_precision="ieee")
    tl.store(out_ptr + pos[:, None] * stride_out + n[None, :], acc, mask=row_mask[:, None] & n_mask[None, :])


# The last step's groups and what was made of them: every layer of a step gets the same groups list.
_last: tuple[object, tuple[torch.Tensor, ...]] | None = None


def _step_tables(groups: list[tuple[int, torch.Tensor]], device: torch.device) -> tuple[torch.Tensor, ...]:
    """The grouped rows and the tile table of ``groups``, made once per step (per groups list)."""
    global _last
    if _last is None or _last[0] is not groups:
        _last = (groups, (torch.cat([r for _, r in groups]), *_tiles(groups, device)))
    return _last[1]


def _tiles(groups: list[tuple[int, torch.Tensor]], device: torch.device) -> tuple[torch.Tensor, ...]:
    """Each tile's (slot, start in the grouped order, rows): groups cut in tiles of BLOCK_M rows."""
    slots, starts, counts = [], [], []
    offset = 0
    for slot, rows in groups:
        n = rows.shape[0]
        for begin in range(0, n, BLOCK_M):
            slots.append(slot)
            starts.append(offset + begin)
            counts.append(min(BLOCK_M, n - begin))
        offset += n
    table = torch.tensor([slots, starts, counts], dtype=torch.int32).to(device)
    return table[0], table[1], table[2]


def lora_delta(
    x: torch.Tensor, stack: LoRAStack, groups: list[tuple[int, torch.Tensor]]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """As ``LoRADelta``: for each (slot, rows) group, (rows, the float32 delta of those rows [n, out]); the
    stack's tensors contiguous, on x's device."""
    if not groups:
        return []
    a, bt, ranks = stack.a, stack.bt, stack.ranks
    rows, tile_slot, tile_start, tile_count = _step_tables(groups, x.device)
    total, k, rank, n_out, n_parts = rows.shape[0], x.shape[1], a.shape[2], bt.shape[2], a.shape[1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    mid = torch.zeros(total, rank, dtype=torch.float32, device=x.device)
    out = torch.zeros(total, n_out, dtype=torch.float32, device=x.device)
    tiles = tile_slot.shape[0]
    block_w = 32
    for i, (start, count) in enumerate(stack.parts):
        a_part, b_part, out_part = a[:, i], bt[:, :, start : start + count], out[:, start:]
        _shrink_kernel[(tiles, triton.cdiv(rank, block_w))](
            x, a_part, mid, rows, tile_slot, tile_start, tile_count, ranks, i, n_parts, k, x.stride(0),
            a_part.stride(0), a_part.stride(1), mid.stride(0), BLOCK_M=BLOCK_M, BLOCK_W=block_w, BLOCK_K=BLOCK_K,
        )  # fmt: skip
        _expand_kernel[(tiles, triton.cdiv(count, BLOCK_N))](
            mid, b_part, out_part, tile_slot, tile_start, tile_count, ranks, i, n_parts, count, rank, mid.stride(0),
            b_part.stride(0), b_part.stride(1), out.stride(0), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_W=block_w,
        )  # fmt: skip
    pieces, offset = [], 0
    for _, r in groups:
        pieces.append((r, out[offset : offset + r.shape[0]]))
        offset += r.shape[0]
    return pieces
