"""Exact re-encodings of GGUF formats the native kernels do not read into ones they do.

A format can be another one's arithmetic with fewer bits a weight, so that its blocks can be rewritten
at load, weight for weight and bit for bit, into a format a native kernel multiplies: Q3_K
(``w = (d (sc - 32)) q``, q in -4..3, a 6-bit sc per 16 weights) is Q6_K (``w = (d sc) (q - 32)``, q in
0..63, an int8 sc per 16) with q + 32 and sc - 32, the same float16 d per 256 weights.

Every weight dequantizes to exactly what gguf gives for the original block, and the kernel's products
are exact for the target format, so serving the re-encoded blocks is serving the file's weights. They
take more memory than the file (210 bytes a block for 110): the price of a native kernel over dense
floats (32 bits a weight). The 32-weight formats (Q5_0, IQ4_NL, MXFP4) are read by the block kernels as
stored.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as QType

from tokenmill_service.layers.quant.gguf_blocks import GGUFBlocks, _fields, _split

# Stored format -> the format its blocks are rewritten in.
TRANSCODED: dict[QType, QType] = {QType.Q3_K: QType.Q6_K}


def transcode(tensor: GGUFBlocks) -> GGUFBlocks:
    """``tensor``'s blocks in the format TRANSCODED names for it (unchanged for any other format)."""
    target = TRANSCODED.get(tensor.qtype)
    if target is None:
        return tensor
    return GGUFBlocks(target, _q3_k_as_q6_k(tensor.data.contiguous()))


def _q3_k_as_q6_k(b: torch.Tensor) -> torch.Tensor:
    # Q3_K: 32 bytes hmask | 64 bytes of 2-bit low q | 12 bytes of 6-bit scales | d f16 (gguf_blocks._q3_k).
    sc = b[..., 96:108]
    scales = (_fields(sc[..., 0:8], 4).flatten(-2) | _fields(sc[..., 8:12], 2).flatten(-2) << 4).view(torch.int8) - 32
    low = _fields(_split(b[..., 32:96], 2), 2).flatten(-3)
    offset = (_fields(b[..., 0:32], 1).flatten(-2) ^ 1) << 2
    q6 = low + 32 - offset  # q + 32 in 28..35, weight order
    # Q6_K: per 128-weight half h, weight i's low nibble in byte 64h + i % 64 (high nibble when i >= 64),
    # its two high bits as field i // 32 of byte 32h + i % 32 | 16 int8 scales | d f16.
    halves = q6.reshape(*q6.shape[:-1], 2, 128)
    nib = halves & 0x0F
    ql = (nib[..., 0:64] | nib[..., 64:128] << 4).flatten(-2)
    hi = (halves >> 4).reshape(*q6.shape[:-1], 2, 4, 32)
    qh = (hi[..., 0, :] | hi[..., 1, :] << 2 | hi[..., 2, :] << 4 | hi[..., 3, :] << 6).flatten(-2)
    return torch.cat((ql, qh, scales.view(torch.uint8), b[..., 108:110]), dim=-1)
