"""FP8 block-scaled weights served as stored (``fp8-block``): DeepSeek-V3's e4m3 values with a float32
scale per block (``quantization_config.quant_method == "fp8"`` with ``weight_block_size``).

The layer keeps the e4m3 values [out, in] (one byte a weight) and, for each row, the scale of each
column block [out, ceil(in / block_cols)] (rows keep their own scales, so packed projections and
tensor-parallel row shards need not fall on block rows; a column shard must hold whole blocks).
``apply`` multiplies one column block at a time: the tile is dequantized exactly (value * scale, as
``Fp8Blocks.dequantize`` and the reference do), its product taken in float32, and the tiles' products
added in column order. Each tile's product is tokenmill's native float32 kernel where it runs (each
row summed on its own in a fixed order: batch-invariant by construction), elsewhere the sliced torch
product (dense.py's ``batch_invariant_matmul``), whose rows are independent only where MKL makes them
so (Intel CPUs; not on an AMD EPYC), as for dense float32 layers without the native kernel.
Activations are float32 inside whatever their dtype; the output is in the activations' dtype.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tokenmill_service.worker.kernels import block_gemm as native
from tokenmill_service.worker.layers.quant.base import QuantMethod, empty_param, register_quantization
from tokenmill_service.worker.layers.quant.dense import batch_invariant_matmul
from tokenmill_service.worker.layers.quant.fp8_tensor import FP8_DTYPE, Fp8Blocks
from tokenmill_service.worker.layers.quant.gguf_blocks import QUANT_BLOCK, CheckpointTensor, describe

if TYPE_CHECKING:
    from tokenmill_service.worker.device import DeviceFacts
    from tokenmill_service.worker.layers.linear import LinearBase

# The tile products: tokenmill's native float32 kernel, or the sliced torch product.
NATIVE_TILES, SLICED_TILES = "fp8-tiles/block_gemm-f32", "fp8-tiles/sliced-matmul"


@register_quantization("fp8-block")
class Fp8BlockMethod(QuantMethod):
    @classmethod
    def kernel_for(cls, facts: DeviceFacts, act_dtype: torch.dtype) -> str:
        return NATIVE_TILES if facts.native("block_gemm") is None else SLICED_TILES

    def create_weights(self, layer: LinearBase, out_features: int, in_features: int) -> None:
        layer.weight = empty_param(out_features, in_features, dtype=FP8_DTYPE)
        self.block_cols = 0  # from the checkpoint's first piece; every piece must agree

    def load_rows(self, layer: LinearBase, rows: slice, tensor: CheckpointTensor) -> None:
        if not isinstance(tensor, Fp8Blocks):
            raise ValueError(f"fp8-block serves FP8 block-scaled weights, not {describe(tensor)}")  # noqa: TRY004
        if self.block_cols == 0:
            self.block_cols = tensor.block[1]
            blocks = -(-layer.weight.shape[1] // self.block_cols)
            layer.weight_scale = empty_param(layer.weight.shape[0], blocks, dtype=torch.float32).to(layer.weight.device)
        elif tensor.block[1] != self.block_cols:
            raise ValueError(f"pieces of one layer in different FP8 blocks ({self.block_cols} and {tensor.block[1]})")
        layer.weight.data[rows] = tensor.values.to(layer.weight.device)
        layer.weight_scale.data[rows] = tensor.column_block_scales().to(layer.weight.device)

    def _tile(self, layer: LinearBase, j: int) -> torch.Tensor:
        """Column block j of the weight, dequantized exactly: float32 [out, block_cols]."""
        start = j * self.block_cols
        values = layer.weight[:, start : start + self.block_cols]
        return values.float() * layer.weight_scale[:, j : j + 1]

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out: torch.Tensor | None = None
        for j in range(layer.weight_scale.shape[1]):
            start = j * self.block_cols
            tile = self._tile(layer, j)
            part = xf[:, start : start + tile.shape[1]]
            if self.kernel == NATIVE_TILES and x.device.type == "cpu" and tile.shape[1] % QUANT_BLOCK == 0:
                y = native.block_gemm(part.contiguous(), tile.contiguous(), native.F32, tile.shape[0])
            else:
                y = batch_invariant_matmul(part, tile.t().contiguous())
            out = y if out is None else out + y
        assert out is not None
        return out.to(self.act_dtype)

    def dequantized(self, layer: LinearBase) -> torch.Tensor:
        scales = layer.weight_scale.repeat_interleave(self.block_cols, dim=1)[:, : layer.weight.shape[1]]
        return layer.weight.float() * scales

    def weight_bytes(self, layer: LinearBase) -> int:
        return int(layer.weight.numel() + layer.weight_scale.numel() * 4)
