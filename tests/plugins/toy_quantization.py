"""A quantization method added the way a new format is: this one file and its registration (declaring the name).

Weights stored as float32 rows scaled by a power of two per row (exact), multiplied back in
float32: a format in miniature, enough to show the plan choose it and the model run it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from tokenmill_service.worker.layers.quant.base import QuantMethod, empty_param, register_quantization
from tokenmill_service.worker.layers.quant.gguf_blocks import CheckpointTensor, dense

if TYPE_CHECKING:
    from tokenmill_service.worker.device import DeviceFacts


@register_quantization("toy-pow2", help="float32 rows scaled by a power of two per row")
class Pow2RowsMethod(QuantMethod):
    @classmethod
    def unavailable_reason(cls, facts: DeviceFacts, act_dtype: torch.dtype) -> str | None:
        return None if act_dtype == torch.float32 else "it multiplies float32 activations"

    @classmethod
    def kernel_for(cls, facts: DeviceFacts, act_dtype: torch.dtype) -> str:
        return "torch-matmul"

    def create_weights(self, layer: nn.Module, out_features: int, in_features: int) -> None:
        layer.rows = empty_param(out_features, in_features, dtype=torch.float32)
        layer.exponent = empty_param(out_features, 1, dtype=torch.float32)

    def load_rows(self, layer: nn.Module, rows: slice, tensor: CheckpointTensor) -> None:
        w = dense(tensor).float()
        exponent = torch.floor(torch.log2(w.abs().amax(dim=1, keepdim=True).clamp_min(1e-30)))
        layer.exponent.data[rows] = exponent
        layer.rows.data[rows] = torch.ldexp(w, -exponent)  # exact: a power-of-two scale

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return x @ self.dequantized(layer).t()

    def dequantized(self, layer: nn.Module) -> torch.Tensor:
        return torch.ldexp(layer.rows, layer.exponent)

    def weight_bytes(self, layer: nn.Module) -> int:
        return int(layer.rows.numel() * 4 + layer.exponent.numel() * 4)
