"""Int8 weight-only, one scale per output channel: ``torch._weight_int8pack_mm`` on the CPU.

Float weights are quantized symmetrically per row (scale = max |w| / 127). A GGUF Q8_0 tensor
has a scale per 32 weights, which this kernel cannot express: its rows are dequantized and
re-quantized per channel (a small, stated loss; int4 tensors are taken as they are).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tokenmill_service.worker.layers.quant.base import (
    QuantMethod,
    kernel_dtype,
    register_quantization,
    split_bf16_matmul,
)
from tokenmill_service.worker.layers.quant.gguf_blocks import CheckpointTensor, dense

if TYPE_CHECKING:
    from tokenmill_service.worker.layers.linear import LinearBase


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [N, K] -> (int8 [N, K], float32 scales [N]) with w ~= q * scale."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


@register_quantization("int8")
class Int8Method(QuantMethod):
    def create_weights(self, layer: LinearBase, out_features: int, in_features: int) -> None:
        layer.register_buffer("qweight", torch.empty(out_features, in_features, dtype=torch.int8))
        layer.register_buffer("scales", torch.empty(out_features, dtype=torch.float32))
        layer.register_buffer("kernel_scales", torch.empty(0), persistent=False)

    def load_rows(self, layer: LinearBase, rows: slice, tensor: CheckpointTensor) -> None:
        q, scale = quantize_per_channel(dense(tensor))
        layer.qweight[rows] = q
        layer.scales[rows] = scale

    def finalize(self, layer: LinearBase) -> None:
        layer.kernel_scales = layer.scales.to(kernel_dtype(self.act_dtype))

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        def kernel(a: torch.Tensor) -> torch.Tensor:
            if a.device.type == "cpu":
                return torch._weight_int8pack_mm(a, layer.qweight, layer.kernel_scales)
            # Elsewhere: dequantize on the fly (correct, not yet a fused kernel).
            return (a @ layer.qweight.to(a.dtype).t()) * layer.kernel_scales

        return split_bf16_matmul(kernel, x)

    def dequantized(self, layer: LinearBase) -> torch.Tensor:
        return layer.qweight.float() * layer.scales[:, None]

    def weight_bytes(self, layer: LinearBase) -> int:
        return layer.qweight.numel() + layer.kernel_scales.numel() * layer.kernel_scales.element_size()
