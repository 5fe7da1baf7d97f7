"""Exact re-encodings of GGUF formats the native kernels do not read into ones they do.

Some formats are another one's arithmetic with fewer bits a weight, so their blocks can be rewritten
at load, weight for weight and bit for bit, into a format a native kernel multiplies:

- Q5_0 (``w = d (q - 16)``, q in 0..31) and IQ4_NL (``w = d level[q]``, levels in -127..113) are Q8_0
  (``w = d q``, q an int8) with the same float16 d per 32 weights;
- MXFP4 (``w = v 2^(E - 128)``, v a doubled e2m1 value in -12..12) is Q8_0 with d = 2^(E - 128) as
  float16, exact for E - 128 in [-24, 15] (mxfp4.py; a scale beyond that is refused with what to do);
- Q3_K (``w = (d (sc - 32)) q``, q in -4..3, a 6-bit sc per 16 weights) is Q6_K (``w = (d sc) (q - 32)``,
  q in 0..63, an int8 sc per 16) with q + 32 and sc - 32, the same float16 d per 256 weights.

Every weight dequantizes to exactly what gguf gives for the original block, and the kernels' products
are exact for the target format, so serving the re-encoded blocks is serving the file's weights. They
take more memory than the file (per block, Q5_0 34 bytes for 22, IQ4_NL 34 for 18, MXFP4 34 for 17, Q3_K 274 for 110 in
the k-quant kernel's layout): the price of a native kernel over dense floats (32 bits a weight).
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as QType

from tokenmill_service.layers.quant.gguf_blocks import _IQ4_LEVELS, GGUFBlocks, _fields, _q5, _split
from tokenmill_service.layers.quant.mxfp4 import as_q8_0

# Stored format -> the format its blocks are rewritten in.
TRANSCODED: dict[QType, QType] = {
    QType.Q5_0: QType.Q8_0,
    QType.IQ4_NL: QType.Q8_0,
    QType.MXFP4: QType.Q8_0,
    QType.Q3_K: QType.Q6_K,
}


def transcode(tensor: GGUFBlocks) -> GGUFBlocks:
    """``tensor``'s blocks in the format TRANSCODED names for it (unchanged for any other format)."""
    target = TRANSCODED.get(tensor.qtype)
    if target is None:
        return tensor
    if tensor.qtype == QType.MXFP4:
        return as_q8_0(tensor)
    b = tensor.data.contiguous()
    if tensor.qtype == QType.Q3_K:
        return GGUFBlocks(target, _q3_k_as_q6_k(b))
    if tensor.qtype == QType.Q5_0:  # d f16 | qh u32 | 16 bytes of nibbles
        q = _q5(b, 2).view(torch.int8) - 16
    else:  # IQ4_NL: d f16 | 16 bytes of level indices
        q = _IQ4_LEVELS.to(torch.int8)[_fields(b[..., 2:18], 4).flatten(-2).long()]
    return GGUFBlocks(target, torch.cat((b[..., 0:2], q.view(torch.uint8)), dim=-1))


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
