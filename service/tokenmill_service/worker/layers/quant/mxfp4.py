"""MXFP4 weights (the OCP microscaling format gpt-oss's experts ship in): 32 weights a block, each a
4-bit e2m1 value (0, ±0.5, ±1, ±1.5, ±2, ±3, ±4, ±6) times the block's e8m0 scale 2^(E - 127).

Two layouts of the same numbers reach tokenmill:

- GGUF type MXFP4 (llama.cpp, 17 bytes a block): E, then 16 bytes whose low nibbles are weights 0-15
  and high nibbles weights 16-31, each an index into the doubled values (gguf_blocks.MXFP4_VALUES) times
  2^(E - 128); ``GGUFBlocks`` reads it (gguf_blocks._mxfp4), and it is the form tokenmill keeps;
- transformers / openai safetensors (``<name>_blocks`` uint8 [..., blocks, 16], ``<name>_scales``
  uint8 [..., blocks]): byte j's low nibble is weight 2j, its high one weight 2j + 1
  (``from_openai`` rewrites them as GGUF blocks, bit for bit the same weights).

Serving: the native block kernels read the GGUF blocks as stored (worker/kernels/cpu/vnni_gemm.cpp and
block_gemm.cpp): a weight is v 2^(E - 128) with v = 2 e2m1 an integer in {0, ±1, ±2, ±3, ±4, ±6, ±8, ±12},
looked up from its 4-bit index in the loop. The VNNI kernel keeps d = 2^(E - 128) as float16, exact for
E - 128 in [-24, 15] (2^-24 is its least subnormal, 2^15 its largest power of two; a block of zeros takes
d = 0); a tensor with a scale beyond that is refused at load with what to do instead (``--quantization
none``, float32 rows, exactly dequantized). Trained weights' scales lie far inside the range.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as QType

from tokenmill_service.worker.layers.quant.gguf_blocks import MXFP4_VALUES, GGUFBlocks, e8m0_half


def from_openai(blocks: torch.Tensor, scales: torch.Tensor) -> GGUFBlocks:
    """transformers' ``<name>_blocks`` [..., rows, n, 16] and ``<name>_scales`` [..., rows, n] (uint8)
    -> GGUF MXFP4 blocks [(...) * rows, n, 17]: the same weights, ggml's nibble order."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair up")
    values = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2)  # weight order, [..., 32]
    packed = values[..., :16] | values[..., 16:] << 4
    data = torch.cat((scales.unsqueeze(-1), packed), dim=-1)
    return GGUFBlocks(QType.MXFP4, data.reshape(-1, *data.shape[-2:]))


def dequantize_openai(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The reference definition, float32 [..., rows, n * 32]: weight 2j + h is
    e2m1(nibble h of byte j) * 2^(scale - 127)."""
    values = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2).long()
    doubled = MXFP4_VALUES[values].float()
    return (doubled * e8m0_half(scales.unsqueeze(-1))).flatten(-2)
