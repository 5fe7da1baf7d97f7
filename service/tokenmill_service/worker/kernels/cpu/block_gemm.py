"""``x @ W.T`` for W in GGUF's block formats, kept as stored (block_gemm.cpp; see there for the
numerics). Under ``torch.compile`` the product is the custom op ``tokenmill::block_gemm``, which
dynamo keeps as one opaque call; eager code calls the library directly, without the dispatcher."""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from tokenmill_service.worker.kernels.cpu import abi, build

# ggml type id -> bytes per block of 32 weights (the formats block_gemm.cpp reads: the native rows of abi.py's table).
F32 = 0  # plain float32 rows: the dense method's weights (worker/layers/quant/dense.py)
FORMATS = abi.NATIVE_FORMATS


def _lib() -> ctypes.CDLL:
    return build.load("block_gemm")  # its functions typed from abi.py


def unavailable_reason() -> str | None:
    return build.unavailable_reason("block_gemm")


def check_status(rc: int, fmt: int, formats: str = "a block format", k_multiple: int = 32) -> None:
    """Raise for the native products' error codes (-1: a ggml type not among the kernel's ``formats``, -2: K
    not a multiple of ``k_multiple``)."""
    if rc == -1:
        raise ValueError(f"ggml type {fmt} is not {formats} the native kernel reads")
    if rc == -2:
        raise ValueError(f"the input dimension must be a multiple of {k_multiple}")


def run_product(
    kernel: Callable[..., int],
    x: torch.Tensor,
    weights: torch.Tensor,
    fmt: int,
    n: int,
    check: Callable[[int, int], None] = check_status,
) -> torch.Tensor:
    """``kernel(fmt, x, M, K, weights, n, y, threads)`` into a new float32 y [M, n] (``check`` raises
    for the kernel's error codes)."""
    x = x.float().contiguous()
    y = torch.empty(x.shape[0], n, dtype=torch.float32, device=x.device)
    if x.shape[0]:
        rc = kernel(
            fmt, x.data_ptr(), x.shape[0], x.shape[1], weights.data_ptr(), n, y.data_ptr(), torch.get_num_threads()
        )
        check(rc, fmt)
    return y


def _gemm(x: torch.Tensor, blocks: torch.Tensor, fmt: int, n: int) -> torch.Tensor:
    return run_product(_lib().tm_block_gemm, x, blocks, fmt, n)


@torch.library.custom_op("tokenmill::block_gemm", mutates_args=())
def _block_gemm_op(x: torch.Tensor, blocks: torch.Tensor, fmt: int, n: int) -> torch.Tensor:
    return _gemm(x, blocks, fmt, n)


@_block_gemm_op.register_fake
def _(x: torch.Tensor, blocks: torch.Tensor, fmt: int, n: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], n, dtype=torch.float32)


def block_gemm(x: torch.Tensor, blocks: torch.Tensor, fmt: int, n: int) -> torch.Tensor:
    """``x [M, K] @ W.T`` as float32 [M, n], for ``blocks`` uint8 [n, K // 32, bytes per block]
    (contiguous, on the CPU) in ggml format ``fmt``. Each row's result is independent of M."""
    if torch.compiler.is_compiling():
        y: torch.Tensor = _block_gemm_op(x, blocks, fmt, n)  # (a custom op's call is untyped)
        return y
    return _gemm(x, blocks, fmt, n)


def run_dequantize(
    kernel: Callable[..., int],
    weights: torch.Tensor,
    fmt: int,
    n: int,
    k: int,
    check: Callable[[int, int], None] = check_status,
) -> torch.Tensor:
    """``kernel(fmt, weights, n, k, out)`` into a new float32 out [n, k] (``check`` raises for the kernel's
    error codes)."""
    out = torch.empty(n, k, dtype=torch.float32, device=weights.device)
    check(kernel(fmt, weights.data_ptr(), n, k, out.data_ptr()), fmt)
    return out


def block_dequantize(blocks: torch.Tensor, fmt: int) -> torch.Tensor:
    """The weight [n, K] as float32, exactly the values ``block_gemm`` multiplies by."""
    blocks = blocks.contiguous()
    return run_dequantize(_lib().tm_block_dequantize, blocks, fmt, blocks.shape[0], blocks.shape[1] * 32)
