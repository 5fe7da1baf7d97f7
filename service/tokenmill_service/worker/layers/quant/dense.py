"""Unquantized weights in the activation dtype (float32 or bfloat16).

float32, on a CPU where tokenmill's native kernels build: the weight stays [out, in] and is
multiplied by ``worker/kernels/cpu/block_gemm.cpp`` as plain float32 rows (its F32 format), each output summed
in one fixed order whatever the number of rows, so batch-invariant by construction, on any
AVX-512 CPU. That keeps a sequence's logits independent of its batch.

float32 elsewhere (no native kernel, or the tensors on a GPU): the weight is stored transposed
([in, out]) and the product is taken in slices of the input dimension, added in float32. Measured
on MKL on Intel CPUs, ``x @ w`` with row-major ``w`` and a reduction of at most a few hundred gives
each output row the same bits whatever the number of rows (from two; one row takes the gemv path,
so a lone row is padded), which ``F.linear`` over the whole width does not. That is a property of
one library on one kind of CPU, not a construction: on an AMD EPYC it does not hold (a row alone
and among 64 differ in the last bits), which is why the native kernel is preferred.

bfloat16: ``F.linear`` on the usual [out, in] weight, oneDNN's fast path (the sliced product above
runs about four times slower in bfloat16). Its rows are not independent of the row count, so this
one mode (``--quantization none --dtype bfloat16``) does not promise batch invariance.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F

from tokenmill_service.worker.kernels import block_gemm as native
from tokenmill_service.worker.layers.quant.base import QuantMethod, empty_param, register_quantization
from tokenmill_service.worker.layers.quant.gguf_blocks import QUANT_BLOCK, CheckpointTensor, dense

if TYPE_CHECKING:
    from tokenmill_service.worker.device import DeviceFacts
    from tokenmill_service.worker.layers.linear import LinearBase

K_SLICE = 256


def batch_invariant_matmul(x: torch.Tensor, wt: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ wt [K, N], each row's result independent of M; float32 out for float32 in."""
    m = x.shape[0]
    if m == 1:
        x = torch.cat((x, torch.zeros_like(x)))
    out: torch.Tensor | None = None
    for start in range(0, wt.shape[0], K_SLICE):
        y = (x[:, start : start + K_SLICE] @ wt[start : start + K_SLICE]).float()
        out = y if out is None else out + y
    assert out is not None
    return out[:m].to(x.dtype)


# The dense kernels: float32 rows in the native block kernel; float32 in slices of the input (torch);
# F.linear (bfloat16).
NATIVE_F32, SLICED, LINEAR = "block_gemm-f32", "sliced-matmul", "linear"


@register_quantization("none")
class DenseMethod(QuantMethod):
    native_entry_points: ClassVar[dict[str, tuple[str, str]]] = {NATIVE_F32: ("block_gemm", "tm_block_gemm")}

    @classmethod
    def kernel_for(cls, facts: DeviceFacts, act_dtype: torch.dtype) -> str:
        if act_dtype != torch.float32:
            return LINEAR
        return NATIVE_F32 if facts.native("block_gemm") is None else SLICED

    @property
    def invariant(self) -> bool:
        return self.act_dtype == torch.float32

    def create_weights(self, layer: LinearBase, out_features: int, in_features: int) -> None:
        # float32 rows for the native kernel where the plan chose it (also read by the native decoder
        # stack); a layer whose width is not whole blocks takes the sliced product instead.
        self.native = self.kernel == NATIVE_F32 and in_features % QUANT_BLOCK == 0
        if self.kernel == NATIVE_F32 and not self.native:
            self.kernel = SLICED
        if self.invariant and not self.native:
            layer.weight_t = empty_param(in_features, out_features, dtype=self.act_dtype)
        else:
            layer.weight = empty_param(out_features, in_features, dtype=self.act_dtype)

    def load_rows(self, layer: LinearBase, rows: slice, tensor: CheckpointTensor) -> None:
        if self.invariant and not self.native:
            layer.weight_t.data[:, rows] = dense(tensor).t().to(self.act_dtype)
        else:
            layer.weight.data[rows] = dense(tensor).to(self.act_dtype)

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        if self.native:
            if x.device.type == "cpu":
                return native.block_gemm(x, layer.weight, native.F32, layer.weight.shape[0])
            return batch_invariant_matmul(x, layer.weight.t())
        if self.invariant:
            return batch_invariant_matmul(x, layer.weight_t)
        return F.linear(x, layer.weight)

    def native_operands(self, layer: LinearBase) -> tuple[torch.Tensor, int]:
        return layer.weight, native.F32

    def _stored(self, layer: LinearBase) -> torch.Tensor:
        return layer.weight_t.t() if self.invariant and not self.native else layer.weight

    def dequantized(self, layer: LinearBase) -> torch.Tensor:
        return self._stored(layer).float()

    def weight_bytes(self, layer: LinearBase) -> int:
        w = self._stored(layer)
        return w.numel() * w.element_size()
