"""GGUF's block-quantized tensors (llama.cpp's formats), kept quantized until a layer decides.

A ``GGUFBlocks`` is a weight matrix [rows, cols] stored as rows of 32-weight blocks. Layers take
row and column slices of it (packed projections, tensor-parallel shards) before anything is
dequantized, and a quantization method either reads the blocks as they are (Q4_0 and Q4_1 are
group-wise int4 with a scale and a minimum per 32 weights) or dequantizes its slice.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType as QType

from tokenmill_service.kernels.cpu.abi import BLOCK_FORMATS, QUANT_BLOCK

# Bytes per block of QUANT_BLOCK weights, for the quantized formats (from the one table the C++ shares).
BLOCK_BYTES = {QType[f.name]: f.block_bytes for f in BLOCK_FORMATS if f.name != "F32"}
FLOAT_TYPES = (QType.F32, QType.F16, QType.BF16)


def _f16_column(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The little-endian float16 at byte ``start`` of each block, as float32 [..., 1]."""
    return blocks[..., start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Low nibbles are weights 0..15 of a block, high nibbles 16..31 (ggml's layout)."""
    return torch.cat((packed & 0x0F, packed >> 4), dim=-1)


@dataclass(slots=True)
class GGUFBlocks:
    """A block-quantized matrix: ``data`` is uint8 [rows, cols // 32, bytes per block]."""

    qtype: QType
    data: torch.Tensor

    @classmethod
    def from_raw(cls, raw: np.ndarray, qtype: QType, shape: tuple[int, int]) -> GGUFBlocks:
        rows, cols = shape
        # A view of the read-only memory-mapped file (never written), until a slice of it is used.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            data = torch.from_numpy(np.asarray(raw).view(np.uint8))
        data = data.view(rows, cols // QUANT_BLOCK, BLOCK_BYTES[qtype])
        return cls(qtype, data)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.data.shape[0], self.data.shape[1] * QUANT_BLOCK)

    def rows(self, index: torch.Tensor | slice) -> GGUFBlocks:
        return GGUFBlocks(self.qtype, self.data[index])

    def narrow(self, dim: int, start: int, length: int) -> GGUFBlocks:
        if dim == 0:
            return GGUFBlocks(self.qtype, self.data[start : start + length])
        if start % QUANT_BLOCK or length % QUANT_BLOCK:
            raise ValueError(
                f"a {self.qtype.name} tensor can only be split along its columns at multiples of {QUANT_BLOCK}"
            )
        return GGUFBlocks(self.qtype, self.data[:, start // QUANT_BLOCK : (start + length) // QUANT_BLOCK])

    def int4_groups(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Q4_0 / Q4_1 as they are: (qs uint8 [rows, groups, 16] in GGUF's nibble order, scale and
        minimum float32 [rows, groups]) with weight = q * scale + minimum exactly as gguf computes it."""
        blocks = self.data.contiguous()
        d = _f16_column(blocks, 0)[..., 0]
        if self.qtype == QType.Q4_0:  # weight = (q - 8) d = q d - 8 d; both products are exact in float32
            return blocks[..., 2:], d, -8 * d
        if self.qtype == QType.Q4_1:  # weight = q d + m
            return blocks[..., 4:], d, _f16_column(blocks, 2)[..., 0]
        raise ValueError(f"{self.qtype.name} is not a 4-bit format")

    def dequantize(self) -> torch.Tensor:
        """Float32 [rows, cols], bit for bit what ``gguf.quants.dequantize`` gives."""
        blocks = self.data.contiguous()
        d = _f16_column(blocks, 0)
        if self.qtype == QType.Q8_0:
            out = blocks[..., 2:].view(torch.int8).float().mul_(d)
        elif self.qtype == QType.Q4_0:
            out = (_nibbles(blocks[..., 2:]).view(torch.int8) - 8).float().mul_(d)
        else:  # Q4_1
            out = _nibbles(blocks[..., 4:]).float().mul_(d).add_(_f16_column(blocks, 2))
        return out.reshape(self.shape)


CheckpointTensor = torch.Tensor | GGUFBlocks


def dense(t: CheckpointTensor) -> torch.Tensor:
    """A checkpoint tensor as float (dequantized when block-quantized)."""
    return t.dequantize() if isinstance(t, GGUFBlocks) else t
