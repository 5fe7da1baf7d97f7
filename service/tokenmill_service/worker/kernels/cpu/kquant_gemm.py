"""``x @ W.T`` for W in llama.cpp's k-quants (Q2_K, Q4_K, Q5_K, Q6_K, IQ4_XS) with 16-bit fixed-point activations and
integer products (kquant_gemm.cpp; see there for the numerics and the packed layout). A layer whose
row ranges are stored in different k-quants (a packed q/k/v with v in Q6_K, as Q4_K_M files have it)
is packed as segments behind a header (``pack_segments``) and multiplied in one call. Under
``torch.compile`` the product is the custom op ``tokenmill::kquant_gemm``; eager code calls the
library directly."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from tokenmill_service.worker.kernels.cpu import abi, block_gemm, build, huge_pages

# ggml type id -> bytes per super-block of 256 weights (the formats kquant_gemm.cpp reads).
FORMATS = abi.KQUANT_FORMATS
SUPER_BLOCK = abi.SUPER_BLOCK
MIXED = abi.KQUANT_MIXED  # the format id of weights packed as segments
GROUP = 16  # weight rows per packed group: every segment but the last holds whole groups
_ALIGN = 64


def _lib() -> ctypes.CDLL:
    return build.load("kquant_gemm")  # its functions typed from abi.py


def unavailable_reason() -> str | None:
    return build.unavailable_reason("kquant_gemm")


def check_status(rc: int, fmt: int) -> None:
    """Raise for the k-quant kernels' error codes: the block kernels' (in super-blocks), and -3: packed
    segments that do not describe the layer's rows."""
    if rc == -3:
        raise ValueError("the packed segments do not describe the layer's rows")
    block_gemm.check_status(rc, fmt, "a k-quant format", SUPER_BLOCK)


def pack(blocks: torch.Tensor | Sequence[torch.Tensor], fmt: int) -> torch.Tensor:
    """GGUF super-blocks uint8 [n, K // 256, bytes per block] in the kernel's layout (uint8, 1-D). A
    sequence of row ranges (a merged gate/up's parts, as the file stores them) packs as their
    concatenation; each group of rows is its own stretch of the output, so ranges of whole groups are
    packed in place, never copied into one tensor first."""
    pieces = [blocks] if isinstance(blocks, torch.Tensor) else list(blocks)
    if any(piece.shape[0] % GROUP for piece in pieces[:-1]):
        pieces = [torch.cat(pieces)]
    n, k = sum(piece.shape[0] for piece in pieces), pieces[0].shape[1] * SUPER_BLOCK
    out = huge_pages.empty_bytes(int(_lib().tm_kquant_packed_bytes(fmt, n, k)))
    offset = 0
    for piece in pieces:
        piece = piece.contiguous()
        rows = piece.shape[0]
        check_status(_lib().tm_kquant_pack(fmt, piece.data_ptr(), rows, k, out[offset:].data_ptr()), fmt)
        offset += int(_lib().tm_kquant_packed_bytes(fmt, rows, k))
    return out


def pack_segments(segments: list[tuple[torch.Tensor, int]]) -> torch.Tensor:
    """Row ranges stored in different formats, in row order ((blocks, fmt) each, as ``pack`` takes
    them), as one weight of format ``MIXED``: the header (abi.py), then each range packed."""
    if not 1 <= len(segments) <= abi.KQUANT_MAX_SEGMENTS:
        raise ValueError(f"a layer packs 1 to {abi.KQUANT_MAX_SEGMENTS} segments, not {len(segments)}")
    for blocks, _ in segments[:-1]:
        if blocks.shape[0] % GROUP:
            raise ValueError(
                f"a layer stored in several k-quants needs {GROUP}-row multiples before its last format; "
                f"a range has {blocks.shape[0]} rows"
            )
    packed = [pack(blocks, fmt) for blocks, fmt in segments]
    header, offset = [len(segments)], abi.KQUANT_HEADER_BYTES
    for (blocks, fmt), data in zip(segments, packed):
        header += [fmt, blocks.shape[0], offset]
        offset += -(-data.numel() // _ALIGN) * _ALIGN
    out = huge_pages.empty_bytes(offset).zero_()
    out[: 8 * len(header)] = torch.tensor(header, dtype=torch.int64).view(torch.uint8)
    for (_, _, start), data in zip(zip(header[1::3], header[2::3], header[3::3]), packed):
        out[start : start + data.numel()] = data
    return out


def unpack(packed: torch.Tensor, fmt: int, n: int, k: int) -> torch.Tensor:
    """The packed weight [n, k] as float32: exactly what gguf dequantizes the blocks to."""
    return block_gemm.run_dequantize(_lib().tm_kquant_dequantize, packed, fmt, n, k, check_status)


def dequantize_blocks(blocks: torch.Tensor, fmt: int) -> torch.Tensor:
    """GGUF super-blocks uint8 [n, K // 256, bytes per block] as float32 [n, K], exactly as gguf dequantizes
    them: packed into a scratch buffer, then unpacked (a few rows, such as an embedding's looked-up ones, in
    microseconds; the same rows through torch's ops took 0.3 ms a decoding step)."""
    n, k = blocks.shape[0], blocks.shape[1] * SUPER_BLOCK
    blocks = blocks.contiguous()
    packed = torch.empty(int(_lib().tm_kquant_packed_bytes(fmt, n, k)), dtype=torch.uint8, device=blocks.device)
    check_status(_lib().tm_kquant_pack(fmt, blocks.data_ptr(), n, k, packed.data_ptr()), fmt)
    return unpack(packed, fmt, n, k)


def _gemm(x: torch.Tensor, packed: torch.Tensor, fmt: int, n: int, int8: bool) -> torch.Tensor:
    if x.shape[-1] % SUPER_BLOCK:
        check_status(-2, fmt)
    lib = _lib()
    kernel = lib.tm_kquant_gemm_int8 if int8 else lib.tm_kquant_gemm
    return block_gemm.run_product(kernel, x, packed, fmt, n, check_status)


@torch.library.custom_op("tokenmill::kquant_gemm", mutates_args=())
def _kquant_gemm_op(x: torch.Tensor, packed: torch.Tensor, fmt: int, n: int, int8: bool) -> torch.Tensor:
    return _gemm(x, packed, fmt, n, int8)


@_kquant_gemm_op.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, fmt: int, n: int, int8: bool) -> torch.Tensor:
    return x.new_empty(x.shape[0], n, dtype=torch.float32)


def kquant_gemm(x: torch.Tensor, packed: torch.Tensor, fmt: int, n: int, int8: bool = False) -> torch.Tensor:
    """``x [M, K] @ W.T`` as float32 [M, n] for ``packed`` (from ``pack`` or ``pack_segments``) in format
    ``fmt``, with ``x`` rounded to 16-bit fixed point per block of 32 first (as ``vnni_gemm.quantize``
    shows it), or with ``int8`` to 8-bit integers (as ``vnni_gemm.quantize_int8`` shows it). Each row's
    result is independent of M."""
    if torch.compiler.is_compiling():
        y: torch.Tensor = _kquant_gemm_op(x, packed, fmt, n, int8)  # (a custom op's call is untyped)
        return y
    return _gemm(x, packed, fmt, n, int8)
