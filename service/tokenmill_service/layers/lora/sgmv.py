"""The batched LoRA product: every token's delta ``(x @ A[s].T) @ B[s].T`` by its adapter slot ``s``.

Adapters are stacked in slots (``a`` [slots, R, in], ``b`` [slots, out, R], ranks zero-padded to
``R``, the scale folded into ``b``). ``lora_delta`` groups the tokens by slot, as SGMV (Punica,
S-LoRA) does: one shrink and one expand per adapter in the batch, however many tokens use it.

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
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, groups: list[tuple[int, torch.Tensor]]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """For each (slot, rows) group: (rows, the float32 delta of those rows [n, out])."""
    out = []
    for slot, rows in groups:
        xs = x.index_select(0, rows).float()
        out.append((rows, rowwise_matmul(rowwise_matmul(xs, a[slot]), b[slot])))
    return out


def lora_delta_reference(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, token_slots: list[int]) -> torch.Tensor:
    """The definition, token by token in float64: delta [T, out] (zero where the slot is -1)."""
    delta = torch.zeros(x.shape[0], b.shape[1], dtype=torch.float64)
    for t, slot in enumerate(token_slots):
        if slot >= 0:
            delta[t] = (x[t].double() @ a[slot].double().t()) @ b[slot].double().t()
    return delta
