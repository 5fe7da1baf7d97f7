"""The batched LoRA product: every token's delta ``(x @ A[s].T) @ B[s].T`` by its adapter slot ``s``.

Adapters are stacked in slots (``a`` [slots, P, R, in] for a layer of P projections, ``bt`` [slots, R,
out]: B transposed, the scale folded in; float32, or bfloat16 by default), ``ranks`` [slots, P] saying
how many of each block's R rows the slot's adapter fills (0: that projection is not targeted): only
those rows are read. Each projection's output columns are the product of its own block of A.
``lora_delta`` groups the tokens by slot, as SGMV (Punica, S-LoRA) does: one shrink and one expand per
adapter in the batch (and projection of a packed layer), however many tokens use it, accumulated in
float32.

Batch invariance: a token's delta must not depend on the tokens around it, so each product is one
whose rows are independent of the row count: on a CPU tokenmill's native kernel
(worker/kernels/cpu/lora.cpp, each output summed in one fixed order; the eager layers and the native decoder
stack call it directly), elsewhere the dense method's sliced product (worker/layers/quant/dense.py, with that
method's caveat). ``lora_delta_reference`` is the plain per-token definition the tests hold it to.

Under ``--backend triton`` the layers use worker/kernels/triton/lora.py's ``lora_delta``, with this signature.
"""

from __future__ import annotations

import torch

from tokenmill_service.worker.kernels import LoRAStack
from tokenmill_service.worker.kernels import lora as native
from tokenmill_service.worker.layers.quant.dense import batch_invariant_matmul


def native_reads(x: torch.Tensor, a: torch.Tensor) -> bool:
    """Whether worker/kernels/cpu/lora.cpp takes these operands."""
    return (
        x.device.type == "cpu"
        and a.device.type == "cpu"
        and x.shape[1] % 16 == 0
        and a.dtype in native.DTYPES
        and native.unavailable_reason() is None
    )


def part_table(parts: list[tuple[int, int]]) -> torch.Tensor:
    return torch.tensor(parts, dtype=torch.int64).reshape(-1, 2)


def lora_delta(
    x: torch.Tensor, stack: LoRAStack, groups: list[tuple[int, torch.Tensor]]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """As ``LoRADelta``: for each (slot, rows) group, (rows, the float32 delta of those rows [n, out])."""
    a, bt, ranks, parts = stack.a, stack.bt, stack.ranks, stack.parts
    n_out = bt.shape[2]
    if not groups:
        return []
    if native_reads(x, a):
        y = torch.zeros(x.shape[0], n_out, dtype=torch.float32)
        native.lora_add(
            x.float().contiguous(), y, a.contiguous(), bt.contiguous(), ranks.contiguous(), part_table(parts),
            native.Rows.of(groups),
        )  # fmt: skip
        return [(rows, y.index_select(0, rows.cpu())) for _, rows in groups]
    ranks_of = ranks.tolist()
    out = []
    for slot, rows in groups:
        xs = x.index_select(0, rows).float()
        delta = torch.zeros(xs.shape[0], n_out, dtype=torch.float32, device=x.device)
        for p, (start, count) in enumerate(parts):
            r = ranks_of[slot][p]
            if r:
                mid = batch_invariant_matmul(xs, a[slot, p, :r].float().t())
                delta[:, start : start + count] = batch_invariant_matmul(
                    mid, bt[slot, :r, start : start + count].float()
                )
        out.append((rows, delta))
    return out


def lora_delta_reference(x: torch.Tensor, stack: LoRAStack, token_slots: list[int]) -> torch.Tensor:
    """The definition, token by token in float64: delta [T, out] (zero where the slot is -1)."""
    a, bt, ranks, parts = stack.a, stack.bt, stack.ranks, stack.parts
    delta = torch.zeros(x.shape[0], bt.shape[2], dtype=torch.float64)
    for t, slot in enumerate(token_slots):
        for p, (start, count) in enumerate(parts if slot >= 0 else []):
            r = int(ranks[slot, p])
            mid = x[t].double() @ a[slot, p, :r].double().t()
            delta[t, start : start + count] = mid @ bt[slot, :r, start : start + count].double()
    return delta
