"""The batched LoRA product: every token's delta ``(x @ A[s].T) @ B[s].T`` by its adapter slot ``s``.

Adapters are stacked in slots (``a`` [slots, P * R, in] for a layer of P projections, ``b`` [slots,
out, R], ranks zero-padded to ``R``, the scale folded into ``b``): each projection's output rows are
the product of its own block of A's R rows. ``lora_delta`` groups the tokens by slot, as SGMV (Punica,
S-LoRA) does: one shrink and one expand per adapter in the batch (and projection of a packed layer),
however many tokens use it.

Batch invariance: a token's delta must not depend on the tokens around it, so each product is
one whose rows are independent of the row count: tokenmill's native float32 kernel on a CPU
(kernels/cpu/block_gemm.cpp, each output summed in one fixed order), and elsewhere the dense
method's sliced product (layers/quant/dense.py, with that method's caveat). Zero-padded ranks
add exact zeros. ``lora_delta_reference`` is the plain per-token definition the tests hold it to.

The native decoder stack runs these same products inside its one call (kernels/cpu/decoder_stack.cpp,
the same bits), and under ``--backend triton`` the layers use kernels/triton/lora.py's ``lora_delta``.
"""

from __future__ import annotations

import torch

from tokenmill_service.kernels.cpu import block_gemm as native
from tokenmill_service.layers.quant.dense import batch_invariant_matmul


def rowwise_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x [M, K] @ w.T`` for float32 ``w`` [N, K] (contiguous), each row's bits independent of M."""
    if x.device.type == "cpu" and x.shape[1] % 32 == 0 and native.unavailable_reason() is None:
        return native.block_gemm(x, w, native.F32, w.shape[0])
    return batch_invariant_matmul(x.float(), w.t())


def lora_delta(
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    groups: list[tuple[int, torch.Tensor]],
    parts: list[tuple[int, int]] | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """For each (slot, rows) group: (rows, the float32 delta of those rows [n, out]). ``a`` [slots, P * R, in],
    ``b`` [slots, out, R]; ``parts``: the output rows (start, count) of each of the P blocks of A (None:
    one block, every row)."""
    rank, n_out = b.shape[2], b.shape[1]
    parts = parts or [(0, n_out)]
    out = []
    for slot, rows in groups:
        xs = x.index_select(0, rows).float()
        if len(parts) == 1:
            out.append((rows, rowwise_matmul(rowwise_matmul(xs, a[slot]), b[slot])))
            continue
        delta = torch.empty(xs.shape[0], n_out, dtype=torch.float32, device=x.device)
        for i, (start, count) in enumerate(parts):
            mid = rowwise_matmul(xs, a[slot, i * rank : (i + 1) * rank])
            delta[:, start : start + count] = rowwise_matmul(mid, b[slot, start : start + count])
        out.append((rows, delta))
    return out


def lora_delta_reference(
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    token_slots: list[int],
    parts: list[tuple[int, int]] | None = None,
) -> torch.Tensor:
    """The definition, token by token in float64: delta [T, out] (zero where the slot is -1)."""
    rank = b.shape[2]
    parts = parts or [(0, b.shape[1])]
    delta = torch.zeros(x.shape[0], b.shape[1], dtype=torch.float64)
    for t, slot in enumerate(token_slots):
        for i, (start, count) in enumerate(parts if slot >= 0 else []):
            mid = x[t].double() @ a[slot, i * rank : (i + 1) * rank].double().t()
            delta[t, start : start + count] = mid @ b[slot, start : start + count].double().t()
    return delta
