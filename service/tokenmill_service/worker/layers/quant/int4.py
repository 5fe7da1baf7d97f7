"""Int4 weight-only, group-wise (32 weights per group) with a scale and a minimum per group.

weight = q * scale + minimum, q in 0..15: GGUF's Q4_1 exactly (d and m), and Q4_0 with
minimum = -8 d. Those tensors are taken as they are, never dequantized and re-quantized;
float weights are quantized per group (minimum = group min, scale = range / 15).

The CPU kernel (``aten._weight_int4pack_mm_for_cpu``) computes (q - 8) * s + z, so its zero
point is z = minimum + 8 * scale. Its packed layout is opaque, so q is also kept in GGUF's own
nibble layout (a plain copy of the file's bytes at load) for ``dequantized``: bit-exact with
gguf.quants, for tests and checks. The kernel is fast in bfloat16 only; float32 activations go
through it as two bfloat16 halves (see ``split_bf16_matmul``).
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
from tokenmill_service.worker.layers.quant.gguf_blocks import QUANT_BLOCK, CheckpointTensor, GGUFBlocks, dense

if TYPE_CHECKING:
    from tokenmill_service.worker.layers.linear import LinearBase

GROUP = QUANT_BLOCK


def quantize_groups(w: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float [N, K] -> (q uint8 [N, K], scale, minimum float32 [N, K // group]), asymmetric per group."""
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scale = ((hi - lo) / 15).clamp(min=1e-12)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8)
    return q.reshape(n, k), scale, lo


@register_quantization("int4")
class Int4Method(QuantMethod):
    def create_weights(self, layer: LinearBase, out_features: int, in_features: int) -> None:
        if in_features % GROUP:
            raise ValueError(f"int4 needs input features divisible by {GROUP}; this layer has {in_features}")
        groups = in_features // GROUP
        # q in GGUF's nibble order: byte j of a group holds weights j (low) and j + 16 (high).
        layer.register_buffer("qs", torch.empty(out_features, groups, GROUP // 2, dtype=torch.uint8))
        layer.register_buffer("scale", torch.empty(out_features, groups, dtype=torch.float32))
        layer.register_buffer("minimum", torch.empty(out_features, groups, dtype=torch.float32))
        layer.register_buffer("packed", torch.empty(0, dtype=torch.uint8), persistent=False)
        layer.register_buffer("scales_and_zeros", torch.empty(0), persistent=False)

    def load_rows(self, layer: LinearBase, rows: slice, tensor: CheckpointTensor) -> None:
        if isinstance(tensor, GGUFBlocks) and tensor.qtype.name in ("Q4_0", "Q4_1"):
            qs, scale, minimum = tensor.int4_groups()
        else:
            q, scale, minimum = quantize_groups(dense(tensor))
            g = q.reshape(q.shape[0], -1, GROUP)
            qs = g[..., : GROUP // 2] | (g[..., GROUP // 2 :] << 4)
        layer.qs[rows] = qs
        layer.scale[rows] = scale
        layer.minimum[rows] = minimum

    @staticmethod
    def _q(layer: LinearBase) -> torch.Tensor:
        """q as uint8 [N, K] in natural column order."""
        qs = layer.qs
        return torch.cat((qs & 0x0F, qs >> 4), dim=-1).reshape(qs.shape[0], -1)

    def finalize(self, layer: LinearBase) -> None:
        zero = layer.minimum + 8 * layer.scale
        sz = torch.stack((layer.scale, zero), dim=-1).transpose(0, 1).contiguous()  # [K // G, N, 2]
        layer.scales_and_zeros = sz.to(kernel_dtype(self.act_dtype))
        q = self._q(layer).to(torch.int32)
        if q.device.type == "cpu":
            layer.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        else:
            # CUDA's tinygemm layout takes q packed two per byte, the even column in the high nibble.
            layer.packed = torch.ops.aten._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8), 8)

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        def kernel(a: torch.Tensor) -> torch.Tensor:
            y: torch.Tensor  # (torch.ops calls are untyped)
            if a.device.type == "cpu":
                y = torch.ops.aten._weight_int4pack_mm_for_cpu(a, layer.packed, GROUP, layer.scales_and_zeros)
            else:
                y = torch.ops.aten._weight_int4pack_mm(a, layer.packed, GROUP, layer.scales_and_zeros)
            return y

        return split_bf16_matmul(kernel, x)

    def dequantized(self, layer: LinearBase) -> torch.Tensor:
        q = self._q(layer).float().reshape(layer.qs.shape[0], -1, GROUP)
        return (q * layer.scale[..., None] + layer.minimum[..., None]).reshape(q.shape[0], -1)

    def weight_bytes(self, layer: LinearBase) -> int:
        return layer.packed.numel() + layer.scales_and_zeros.numel() * layer.scales_and_zeros.element_size()
