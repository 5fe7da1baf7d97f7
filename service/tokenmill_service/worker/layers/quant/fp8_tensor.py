"""FP8 block-scaled checkpoint tensors (DeepSeek-V3's ``weight`` + ``weight_scale_inv``), kept as stored
until a layer decides.

A weight [rows, cols] is stored as float8 e4m3 values with one float32 scale per block of
``block = (block_rows, block_cols)`` weights (128 x 128 in DeepSeek-V3's checkpoints, the config's
``quantization_config.weight_block_size``); the weight is ``value * scale_inv[row // block_rows,
col // block_cols]``, one float32 product, exactly (e4m3 values are exact in float32). Layers take
row and column slices (packed projections, tensor-parallel shards) before anything is dequantized;
a slice remembers where it sits in the block grid.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

FP8_DTYPE = torch.float8_e4m3fn


@dataclass(frozen=True, slots=True)
class Fp8Blocks:
    values: torch.Tensor  # float8_e4m3fn [rows, cols]: this slice's
    scale_inv: torch.Tensor  # float32 [row blocks, column blocks]: the whole checkpoint tensor's
    block: tuple[int, int]
    row0: int = 0  # where values[0, 0] sits in the whole tensor
    col0: int = 0

    def __post_init__(self) -> None:
        if self.values.dtype != FP8_DTYPE:
            raise ValueError(f"FP8 block-scaled weights must be float8_e4m3fn, not {self.values.dtype}")
        rows, cols = self.row0 + self.values.shape[0], self.col0 + self.values.shape[1]
        need = (-(-rows // self.block[0]), -(-cols // self.block[1]))
        if self.scale_inv.dim() != 2 or any(h < n for h, n in zip(self.scale_inv.shape, need)):
            raise ValueError(
                f"weight_scale_inv {tuple(self.scale_inv.shape)} does not cover a {rows}x{cols} weight "
                f"in blocks of {self.block[0]}x{self.block[1]}"
            )

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    def narrow(self, dim: int, start: int, length: int) -> Fp8Blocks:
        values = self.values.narrow(dim, start, length)
        if dim == 0:
            return replace(self, values=values, row0=self.row0 + start)
        return replace(self, values=values, col0=self.col0 + start)

    def _row_scales(self) -> torch.Tensor:
        """[rows, column blocks of the whole tensor]: each row's scales."""
        rows = (self.row0 + torch.arange(self.values.shape[0], device=self.scale_inv.device)) // self.block[0]
        return self.scale_inv.float().index_select(0, rows)

    def column_block_scales(self) -> torch.Tensor:
        """Each row's scale of each of this slice's column blocks, [rows, ceil(cols / block_cols)]; the
        slice must start at a column block (ValueError otherwise)."""
        if self.col0 % self.block[1]:
            raise ValueError(
                f"a slice of an FP8 weight starting at column {self.col0} splits its {self.block[1]}-column blocks"
            )
        first = self.col0 // self.block[1]
        return self._row_scales()[:, first : first + -(-self.values.shape[1] // self.block[1])].contiguous()

    def dequantize(self) -> torch.Tensor:
        """float32 [rows, cols]: value * scale_inv of its block, bit for bit."""
        cols = (self.col0 + torch.arange(self.values.shape[1], device=self.scale_inv.device)) // self.block[1]
        return self.values.float() * self._row_scales().index_select(1, cols)
