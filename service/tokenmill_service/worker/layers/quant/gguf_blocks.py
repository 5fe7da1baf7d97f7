"""GGUF's block-quantized tensors (llama.cpp's formats), kept quantized until a layer decides.

A ``GGUFBlocks`` is a weight matrix [rows, cols] stored as rows of blocks: 32 weights a block in the
classic formats (Q4_0 .. Q8_0, IQ4_NL), 256 in a k-quant super-block (Q2_K .. Q6_K, IQ4_XS). Layers
take row and column slices of it (packed projections, tensor-parallel shards; columns only at
whole blocks) before anything is dequantized, and a quantization method either reads the blocks as
they are (Q4_0 and Q4_1 are group-wise int4 with a scale and a minimum per 32 weights) or
dequantizes its slice, bit for bit as ``gguf.quants.dequantize`` does.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType as QType

from tokenmill_service.worker.kernels import abi
from tokenmill_service.worker.layers.quant.fp8_tensor import Fp8Blocks

# The quantized formats, from the one table the C++ shares (F32 there is tokenmill's own float32 rows).
QUANT_BLOCK = abi.QUANT_BLOCK
_FORMATS = {QType[f.name]: f for f in abi.BLOCK_FORMATS if f.name != "F32"}
BLOCK_BYTES = {qtype: f.block_bytes for qtype, f in _FORMATS.items()}  # bytes per block
BLOCK_WEIGHTS = {qtype: f.block_weights for qtype, f in _FORMATS.items()}  # weights per block
FLOAT_TYPES = (QType.F32, QType.F16, QType.BF16)

# IQ4_NL's (and IQ4_XS's) 16 levels, ggml's kvalues_iq4nl.
_IQ4_LEVELS = torch.tensor([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113]).float()
# Rows dequantized at once: bounds the temporaries of a large tensor (an embedding) to a few MiB each.
_CHUNK_WEIGHTS = 1 << 20


# --- reading the fields of a block ---------------------------------------------------------------
# Every dequantizer takes blocks uint8 [..., block bytes] and gives float32 [..., block weights].


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The little-endian float16 at byte ``start`` of each block, as float32 [..., 1]."""
    return blocks[..., start : start + 2].contiguous().view(torch.float16).float()


def _fields(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The ``bits``-wide fields of each byte of ``packed`` [..., n], lowest first, as uint8
    [..., 8 // bits, n]: field f of byte j lands at [f, j], ggml's order (for 4 bits, byte j holds
    weight j in its low nibble and weight j + n in its high one)."""
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device).view(-1, 1)
    return (packed.unsqueeze(-2) >> shifts) & ((1 << bits) - 1)


def _split(packed: torch.Tensor, n: int) -> torch.Tensor:
    """``packed`` [..., n * m] as n equal runs [..., n, m] (ggml lays each run out alike)."""
    return packed.reshape(*packed.shape[:-1], n, -1)


def _bits32(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """Bit i of the little-endian uint32 at byte ``start``, for i in 0..31, as int32 [..., 32]."""
    word = blocks[..., start : start + 4].contiguous().view(torch.int32)
    return (word >> torch.arange(32, dtype=torch.int32, device=word.device)) & 1


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    # d f16 | 32 x int8 q.  w = q d
    return b[..., 2:34].view(torch.int8).float() * _f16(b, 0)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    # d f16 | 16 bytes of nibbles (weight j low, j + 16 high).  w = (q - 8) d
    q = _fields(b[..., 2:18], 4).flatten(-2).view(torch.int8) - 8
    return q.float() * _f16(b, 0)


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    # d f16 | m f16 | 16 bytes of nibbles.  w = q d + m
    return _fields(b[..., 4:20], 4).flatten(-2).float() * _f16(b, 0) + _f16(b, 2)


def _q5(b: torch.Tensor, qh_at: int) -> torch.Tensor:
    """Q5_0/Q5_1's 5-bit q in 0..31 as uint8 [..., 32]: bit i of the uint32 ``qh`` is weight i's
    fifth bit, the nibbles below it are Q4's."""
    low = _fields(b[..., qh_at + 4 : qh_at + 20], 4).flatten(-2)
    return low | (_bits32(b, qh_at).to(torch.uint8) << 4)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    # d f16 | qh u32 | 16 bytes of nibbles.  w = (q - 16) d
    return (_q5(b, 2).view(torch.int8) - 16).float() * _f16(b, 0)


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    # d f16 | m f16 | qh u32 | 16 bytes of nibbles.  w = q d + m
    return _q5(b, 4).float() * _f16(b, 0) + _f16(b, 2)


def _iq4_nl(b: torch.Tensor) -> torch.Tensor:
    # d f16 | 16 bytes of nibbles, each an index into _IQ4_LEVELS.  w = level d
    return _IQ4_LEVELS.to(b.device)[_fields(b[..., 2:18], 4).flatten(-2).long()] * _f16(b, 0)


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    # 16 scale bytes (low nibble: sub-block scale, high: its minimum) | 64 bytes of 2-bit q | d f16 | dmin f16.
    # q: byte j of each 32-byte half holds weights j, j + 32, j + 64, j + 96 of that half's 128.
    # Sub-block s (16 weights): w = (d sc_s) q - (dmin m_s)
    scales = b[..., 0:16]
    q = _fields(_split(b[..., 16:80], 2), 2).reshape(*b.shape[:-1], 16, 16).float()
    dl = (_f16(b, 80) * (scales & 0x0F).float()).unsqueeze(-1)
    ml = (_f16(b, 82) * (scales >> 4).float()).unsqueeze(-1)
    return (dl * q - ml).flatten(-2)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    # 32 bytes hmask | 64 bytes of 2-bit low q (as Q2_K) | 12 bytes of 6-bit scales | d f16.
    # Weight i's high bit is bit i // 32 of hmask byte i % 32; a set bit means no offset, a clear one -4.
    # Scale s: low 4 bits are nibble s // 8 of byte s % 8, high 2 bits are field s // 4 of byte 8 + s % 4.
    # Sub-block s (16 weights): w = (d (sc_s - 32)) q
    sc = b[..., 96:108]
    low, high = _fields(sc[..., 0:8], 4).flatten(-2), _fields(sc[..., 8:12], 2).flatten(-2)
    dl = (_f16(b, 108) * ((low | high << 4).view(torch.int8) - 32).float()).unsqueeze(-1)
    ql = _fields(_split(b[..., 32:96], 2), 2).flatten(-3)
    offset = (_fields(b[..., 0:32], 1).flatten(-2) ^ 1) << 2
    q = (ql.view(torch.int8) - offset.view(torch.int8)).float().reshape(*b.shape[:-1], 16, 16)
    return (dl * q).flatten(-2)


def _k_scales(sc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 8 six-bit scales and minimums from their 12 bytes, as float32 [..., 8] each.
    Bytes 0-3 hold scales 0-3 in their low 6 bits, bytes 4-7 minimums 0-3; scales and minimums 4-7
    are the nibbles of bytes 8-11 (low: scale, high: minimum) under the top 2 bits of bytes 0-3 / 4-7."""
    d, m, md = sc[..., 0:4], sc[..., 4:8], sc[..., 8:12]
    scales = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    minimums = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return scales.float(), minimums.float()


def _q4_k_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """128 bytes -> uint8 [..., 8, 32]: byte j of each 32-byte chunk c holds weight j of sub-block
    2c in its low nibble and of sub-block 2c + 1 in its high one."""
    return _fields(_split(qs, 4), 4).flatten(-3, -2)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    # d f16 | dmin f16 | 12 bytes of scales (_k_scales) | 128 bytes of nibbles.
    # Sub-block s (32 weights): w = (d sc_s) q - (dmin m_s)
    scales, minimums = _k_scales(b[..., 4:16])
    dl, ml = (_f16(b, 0) * scales).unsqueeze(-1), (_f16(b, 2) * minimums).unsqueeze(-1)
    return (dl * _q4_k_nibbles(b[..., 16:144]).float() - ml).flatten(-2)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    # As Q4_K with 32 bytes of fifth bits before the nibbles: weight j of sub-block s has bit s of byte j.
    scales, minimums = _k_scales(b[..., 4:16])
    dl, ml = (_f16(b, 0) * scales).unsqueeze(-1), (_f16(b, 2) * minimums).unsqueeze(-1)
    q = _q4_k_nibbles(b[..., 48:176]) | (_fields(b[..., 16:48], 1) << 4)
    return (dl * q.float() - ml).flatten(-2)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    # 128 bytes of low nibbles | 64 bytes of high 2-bit pairs | 16 int8 scales | d f16; q in -32..31.
    # Per 128-weight half h: weight i (0..127) has its nibble in byte 64h + i % 64 (low for i < 64),
    # its high bits as field i // 32 of byte 32h + i % 32.
    # Sub-block s (16 weights): w = (d sc_s) q
    low = _fields(_split(b[..., 0:128], 2), 4).flatten(-3)
    high = _fields(_split(b[..., 128:192], 2), 2).flatten(-3)
    q = ((low | high << 4).view(torch.int8) - 32).float().reshape(*b.shape[:-1], 16, 16)
    dl = (_f16(b, 208) * b[..., 192:208].view(torch.int8).float()).unsqueeze(-1)
    return (dl * q).flatten(-2)


def _iq4_xs(b: torch.Tensor) -> torch.Tensor:
    # d f16 | scales_h u16 | 4 bytes scales_l | 128 bytes of IQ4_NL indices, 16 bytes a sub-block.
    # Scale s (6 bits): nibble s % 2 of scales_l byte s // 2, over bits 2s..2s+1 of scales_h.
    # Sub-block s (32 weights; byte j holds weight j low, j + 16 high): w = (d (sc_s - 32)) level
    low = torch.stack((b[..., 4:8] & 0x0F, b[..., 4:8] >> 4), dim=-1).flatten(-2).int()
    scales_h = b[..., 2].int() | b[..., 3].int() << 8
    high = (scales_h.unsqueeze(-1) >> torch.arange(0, 16, 2, dtype=torch.int32, device=b.device)) & 3
    dl = (_f16(b, 0) * ((low | high << 4) - 32).float()).unsqueeze(-1)
    levels = _IQ4_LEVELS.to(b.device)[_fields(_split(b[..., 8:136], 8), 4).flatten(-2).long()]
    return (dl * levels).flatten(-2)


# MXFP4's 16 e2m1 values, doubled (ggml's kvalues_mxfp4): a weight is one of these times 2^(e - 128).
MXFP4_VALUES = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=torch.int8)


def e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """2^(e - 128) for e8m0 exponents e (uint8), as float32 (ggml's e8m0_to_fp32_half: e < 2 subnormal)."""
    e = e.int()
    bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23)
    return bits.view(torch.float32)


def _mxfp4(b: torch.Tensor) -> torch.Tensor:
    # e8m0 e | 16 bytes of nibbles (weight j low, j + 16 high), each an index into MXFP4_VALUES.
    # w = value 2^(e - 128)
    q = _fields(b[..., 1:17], 4).flatten(-2).long()
    return MXFP4_VALUES.to(b.device)[q].float() * e8m0_half(b[..., 0:1])


_DEQUANTIZERS: dict[QType, Callable[[torch.Tensor], torch.Tensor]] = {
    QType.Q4_0: _q4_0,
    QType.Q4_1: _q4_1,
    QType.Q5_0: _q5_0,
    QType.Q5_1: _q5_1,
    QType.Q8_0: _q8_0,
    QType.Q2_K: _q2_k,
    QType.Q3_K: _q3_k,
    QType.Q4_K: _q4_k,
    QType.Q5_K: _q5_k,
    QType.Q6_K: _q6_k,
    QType.IQ4_NL: _iq4_nl,
    QType.IQ4_XS: _iq4_xs,
    QType.MXFP4: _mxfp4,
}
# Every format of the table can be dequantized, and nothing beyond it is claimed.
assert set(_DEQUANTIZERS) == set(_FORMATS), sorted(t.name for t in set(_DEQUANTIZERS) ^ set(_FORMATS))


@dataclass(slots=True)
class GGUFBlocks:
    """A block-quantized matrix: ``data`` is uint8 [rows, cols // block weights, block bytes]."""

    qtype: QType
    data: torch.Tensor

    @classmethod
    def from_raw(cls, raw: np.ndarray, qtype: QType, shape: tuple[int, int]) -> GGUFBlocks:
        if qtype not in _FORMATS:
            raise ValueError(f"{qtype.name} is not a block format tokenmill reads")
        rows, cols = shape
        if cols % BLOCK_WEIGHTS[qtype]:
            raise ValueError(f"a {qtype.name} row holds whole blocks of {BLOCK_WEIGHTS[qtype]} weights, not {cols}")
        # A view of the read-only memory-mapped file (never written), until a slice of it is used.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            data = torch.from_numpy(np.asarray(raw).view(np.uint8))
        data = data.view(rows, cols // BLOCK_WEIGHTS[qtype], BLOCK_BYTES[qtype])
        return cls(qtype, data)

    @property
    def block_weights(self) -> int:
        return BLOCK_WEIGHTS[self.qtype]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.data.shape[0], self.data.shape[1] * self.block_weights)

    def rows(self, index: torch.Tensor | slice) -> GGUFBlocks:
        return GGUFBlocks(self.qtype, self.data[index])

    def narrow(self, dim: int, start: int, length: int) -> GGUFBlocks:
        if dim == 0:
            return GGUFBlocks(self.qtype, self.data[start : start + length])
        block = self.block_weights
        if start % block or length % block:
            raise ValueError(
                f"a {self.qtype.name} tensor can only be split along its columns at multiples of {block} "
                f"(its blocks hold {block} weights each); columns {start}..{start + length} would split one"
            )
        return GGUFBlocks(self.qtype, self.data[:, start // block : (start + length) // block])

    def int4_groups(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Q4_0 / Q4_1 as they are: (qs uint8 [rows, groups, 16] in GGUF's nibble order, scale and
        minimum float32 [rows, groups]) with weight = q * scale + minimum exactly as gguf computes it."""
        blocks = self.data.contiguous()
        d = _f16(blocks, 0)[..., 0]
        if self.qtype == QType.Q4_0:  # weight = (q - 8) d = q d - 8 d; both products are exact in float32
            return blocks[..., 2:], d, -8 * d
        if self.qtype == QType.Q4_1:  # weight = q d + m
            return blocks[..., 4:], d, _f16(blocks, 2)[..., 0]
        raise ValueError(f"{self.qtype.name} is not a 4-bit format")

    def dequantize(self) -> torch.Tensor:
        """Float32 [rows, cols], bit for bit what ``gguf.quants.dequantize`` gives: by the native kernel that
        reads the format where there is one (tests/engine/test_gguf_loader.py holds both to gguf's, format by format)."""
        rows, cols = self.shape
        native = _native_dequantizer(self.qtype, self.data.device)
        in_torch = _DEQUANTIZERS[self.qtype]

        def dequantize(blocks: torch.Tensor) -> torch.Tensor:
            return native(blocks) if native is not None else in_torch(blocks).reshape(blocks.shape[0], cols)

        step = max(1, _CHUNK_WEIGHTS // max(cols, 1))
        if rows <= step:  # an embedding's looked-up rows: no copy
            return dequantize(self.data.contiguous())
        out = torch.empty(rows, cols, dtype=torch.float32, device=self.data.device)
        for start in range(0, rows, step):
            out[start : start + step] = dequantize(self.data[start : start + step].contiguous())
        return out


def _native_dequantizer(qtype: QType, device: torch.device) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The native kernel's dequantizer of blocks uint8 [rows, blocks, bytes] in ``qtype`` (float32 [rows, cols]),
    or None where no kernel reads the format, the blocks are not in memory, or the kernel cannot be built here.
    A decoding step's embedding lookup of one row took 0.33 ms through torch's ops (a Q6_K row of 2048), the
    Python and the ops' dispatch run cold after a step's weights have streamed through the caches."""
    from tokenmill_service.worker.kernels.cpu import block_gemm, build, kquant_gemm

    kernel = _FORMATS[qtype].kernel
    if device.type != "cpu" or kernel is None:
        return None
    fmt = _FORMATS[qtype].id
    if kernel == "kquant":
        if build.unavailable_reason("kquant_gemm") is not None:
            return None
        return lambda blocks: kquant_gemm.dequantize_blocks(blocks, fmt)
    if build.unavailable_reason("block_gemm") is not None:
        return None
    return lambda blocks: block_gemm.block_dequantize(blocks, fmt)


CheckpointTensor = torch.Tensor | GGUFBlocks | Fp8Blocks


def dense(t: CheckpointTensor) -> torch.Tensor:
    """A checkpoint tensor as float (dequantized when block-quantized: GGUF blocks, FP8 block-scaled)."""
    return t if isinstance(t, torch.Tensor) else t.dequantize()


def describe(t: CheckpointTensor) -> str:
    """What a checkpoint tensor is, for a message: "a torch.float32 tensor", "a Q4_K tensor" or
    "an FP8 block-scaled tensor"."""
    if isinstance(t, GGUFBlocks):
        return f"a {t.qtype.name} tensor"
    if isinstance(t, Fp8Blocks):
        return "an FP8 block-scaled tensor"
    return f"a {t.dtype} tensor"


__all__ = [
    "BLOCK_BYTES",
    "BLOCK_WEIGHTS",
    "FLOAT_TYPES",
    "QUANT_BLOCK",
    "CheckpointTensor",
    "GGUFBlocks",
    "dense",
    "describe",
]
