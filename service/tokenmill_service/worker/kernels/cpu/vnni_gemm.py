"""``x @ W.T`` for W in GGUF's block formats with 16-bit fixed-point activations (or, opted into, 8-bit
ones: ``int8``) and integer products (vnni_gemm.cpp; see there for the numerics and the packed layout). Under
``torch.compile`` the product is the custom op ``tokenmill::vnni_gemm``; eager code calls the
library directly."""

from __future__ import annotations

import ctypes

import torch

from tokenmill_service.worker.kernels.cpu import build, huge_pages
from tokenmill_service.worker.kernels.cpu.block_gemm import check_status, run_dequantize, run_product

GROUP = 16  # weight rows per packed group


def _lib() -> ctypes.CDLL:
    return build.load("vnni_gemm")  # its functions typed from abi.py


def unavailable_reason() -> str | None:
    return build.unavailable_reason("vnni_gemm")


def pack(blocks: torch.Tensor, fmt: int) -> torch.Tensor:
    """GGUF blocks uint8 [n, K // 32, bytes per block] in the kernel's layout (uint8, 1-D)."""
    blocks = blocks.contiguous()
    n, k = blocks.shape[0], blocks.shape[1] * 32
    out = huge_pages.empty_bytes(int(_lib().tm_vnni_packed_bytes(fmt, n, k)))
    rc = _lib().tm_vnni_pack(fmt, blocks.data_ptr(), n, k, out.data_ptr())
    if rc == -3:
        raise ValueError(
            "an MXFP4 block's scale is beyond what the native kernel holds (float16 units 2^-24 .. 2^15, 2^-23 .. "
            "2^16 per e2m1 unit); serve the model with --quantization none (float32 rows, exactly dequantized)"
        )
    check_status(rc, fmt)
    return out


def unpack(packed: torch.Tensor, fmt: int, n: int, k: int) -> torch.Tensor:
    """The packed weight [n, k] as float32: exactly what gguf dequantizes the blocks to."""
    return run_dequantize(_lib().tm_vnni_dequantize, packed, fmt, n, k)


def _gemm(x: torch.Tensor, packed: torch.Tensor, fmt: int, n: int, int8: bool) -> torch.Tensor:
    lib = _lib()
    return run_product(lib.tm_vnni_gemm_int8 if int8 else lib.tm_vnni_gemm, x, packed, fmt, n)


@torch.library.custom_op("tokenmill::vnni_gemm", mutates_args=())
def _vnni_gemm_op(x: torch.Tensor, packed: torch.Tensor, fmt: int, n: int, int8: bool) -> torch.Tensor:
    return _gemm(x, packed, fmt, n, int8)


@_vnni_gemm_op.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, fmt: int, n: int, int8: bool) -> torch.Tensor:
    return x.new_empty(x.shape[0], n, dtype=torch.float32)


def vnni_gemm(x: torch.Tensor, packed: torch.Tensor, fmt: int, n: int, int8: bool = False) -> torch.Tensor:
    """``x [M, K] @ W.T`` as float32 [M, n] for ``packed`` (from ``pack``) in ggml format ``fmt``,
    with ``x`` rounded to 16-bit fixed point per block of 32 first (``quantize``), or with ``int8``
    to 8-bit integers (``quantize_int8``). Each row's result is independent of M."""
    if torch.compiler.is_compiling():
        y: torch.Tensor = _vnni_gemm_op(x, packed, fmt, n, int8)  # (a custom op's call is untyped)
        return y
    return _gemm(x, packed, fmt, n, int8)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [M, K] as the product sees it: int16 [M, K] and each block's unit [M, K // 32]."""
    x = x.float().contiguous()
    q = torch.empty(x.shape, dtype=torch.int16, device=x.device)
    dq = torch.empty(x.shape[0], x.shape[1] // 32, dtype=torch.float32, device=x.device)
    check_status(_lib().tm_vnni_quantize(x.data_ptr(), x.shape[0], x.shape[1], q.data_ptr(), dq.data_ptr()), 0)
    return q, dq


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [M, K] as the ``int8`` product sees it: int8 [M, K] = round(x / d) (ties to even) and
    each block's d = max|x| / 127 [M, K // 32] (llama.cpp's Q8_0 activations)."""
    x = x.float().contiguous()
    q = torch.empty(x.shape, dtype=torch.int8, device=x.device)
    d = torch.empty(x.shape[0], x.shape[1] // 32, dtype=torch.float32, device=x.device)
    check_status(_lib().tm_vnni_quantize_int8(x.data_ptr(), x.shape[0], x.shape[1], q.data_ptr(), d.data_ptr()), 0)
    return q, d
