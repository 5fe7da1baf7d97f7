"""The LoRA deltas added to a layer's product on the CPU (lora.cpp; see there for the layout and the
numerics): every adapter slot of the step and every part of a packed layer in one native call, weights
float32 or bfloat16, products accumulated in float32. The eager layers (worker/layers/lora/slots.py) call it
through ``lora_add``; the native decoder stack calls the same entry point from C++."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from tokenmill_service.worker.kernels.cpu import abi, build

DTYPES = {torch.float32: abi.LORA_DTYPES["float32"], torch.bfloat16: abi.LORA_DTYPES["bfloat16"]}
_Batch = abi.structure("TmLoraBatch")


def _lib() -> ctypes.CDLL:
    return build.load("lora")  # its functions typed from abi.py


def unavailable_reason() -> str | None:
    return build.unavailable_reason("lora")


@dataclass(frozen=True, slots=True)
class Rows:
    """A step's tokens by adapter slot: group g is slot ``slots[g]``, rows ``rows[offsets[g]:offsets[g + 1]]``
    (int64, contiguous, on the CPU)."""

    slots: torch.Tensor
    offsets: torch.Tensor
    rows: torch.Tensor

    @classmethod
    def of(cls, groups: list[tuple[int, torch.Tensor]]) -> Rows:
        counts = torch.tensor([0] + [len(rows) for _, rows in groups], dtype=torch.int64)
        return cls(
            torch.tensor([slot for slot, _ in groups], dtype=torch.int64),
            torch.cumsum(counts, 0),
            torch.cat([rows.cpu() for _, rows in groups]).to(torch.int64).contiguous(),
        )

    def struct(self) -> ctypes.Structure:
        """The ``TmLoraBatch`` pointing into these tensors (keep them alive while it is used)."""
        return _Batch(self.slots.numel(), self.slots.data_ptr(), self.offsets.data_ptr(), self.rows.data_ptr())


def lora_add(
    x: torch.Tensor,
    y: torch.Tensor,
    a: torch.Tensor,
    bt: torch.Tensor,
    ranks: torch.Tensor,
    part_rows: torch.Tensor,
    rows: Rows,
) -> None:
    """``y`` [T, out] (float32, contiguous) += each of ``rows``' deltas, in place. ``x`` [T, in] float32; ``a``
    [slots, parts, R, in] and ``bt`` [slots, R, out] (float32 or bfloat16, contiguous), ``ranks`` int64
    [slots, parts], ``part_rows`` int64 [parts, 2]: each part's output columns (start, count)."""
    assert x.dtype == y.dtype == torch.float32 and x.is_contiguous() and y.is_contiguous()
    assert a.dtype == bt.dtype and a.is_contiguous() and bt.is_contiguous() and ranks.is_contiguous()
    parts, max_rank = a.shape[1], a.shape[2]
    scratch = torch.empty(rows.rows.numel() * parts * max_rank, dtype=torch.float32)
    batch = rows.struct()
    rc = _lib().tm_lora_add(
        DTYPES[a.dtype], x.data_ptr(), x.shape[1], ctypes.byref(batch), a.data_ptr(), bt.data_ptr(),
        ranks.data_ptr(), max_rank, parts, part_rows.data_ptr(), y.shape[1], y.data_ptr(), scratch.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    if rc == -2:
        raise ValueError("the LoRA kernel's input dimension must be a multiple of 16")
    if rc:
        raise ValueError(f"the LoRA kernel refused its operands (code {rc})")
