"""RMSNorm with the residual add, rotary, SiLU-and-mul, Gemma's GeGLU and gpt-oss's clamped SwiGLU in one
native pass each (elementwise.cpp).

Each takes float32 rows (unit stride within a row) and computes every row on its own; callers
check the layout (``fits``) and use the torch reference otherwise.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from tokenmill_service.worker.kernels.cpu import build


def _lib() -> ctypes.CDLL:
    return build.load("elementwise")  # its functions typed from abi.py


def unavailable_reason() -> str | None:
    return build.unavailable_reason("elementwise")


def fits(*tensors: torch.Tensor) -> bool:
    """float32 CPU tensors whose last dimension is contiguous (rows may be strided)."""
    return all(t.dtype == torch.float32 and t.device.type == "cpu" and t.stride(-1) == 1 for t in tensors)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(h) * weight, h) for h = x + residual (or x), x [T, D]; float32."""
    t, d = x.shape
    h, normed = torch.empty(t, d, device=x.device), torch.empty(t, d, device=x.device)
    if residual is not None:
        residual = residual.contiguous()
    _lib().tm_rms_norm(
        x.data_ptr(), x.stride(0), None if residual is None else residual.data_ptr(), weight.contiguous().data_ptr(),
        eps, h.data_ptr(), normed.data_ptr(), t, d,
    )  # fmt: skip
    return normed, h


def rotary_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates x [T, H, R] in place by each row's position; returns x. A head's R dims are contiguous; the
    heads may be further apart (``x.stride(1)`` >= R: the first R dims of wider heads, partial rotary's
    view); cos/sin are [positions, R / 2]."""
    t, heads, rotary_dim = x.shape
    assert x.stride(1) >= rotary_dim and x.stride(2) == 1
    _lib().tm_rotary(
        x.data_ptr(), x.stride(0), t, heads, x.stride(1), rotary_dim, positions.contiguous().data_ptr(),
        cos.contiguous().data_ptr(), sin.contiguous().data_ptr(),
    )  # fmt: skip
    return x


def _gated(kernel: Callable[..., None], x: torch.Tensor, *constants: float) -> torch.Tensor:
    """``kernel(x, out, T, I, *constants)`` of x [T, 2 * I] (gate, up) into a new out [T, I]; float32."""
    t, n2 = x.shape
    x = x.contiguous()
    out = torch.empty(t, n2 // 2, device=x.device)
    kernel(x.data_ptr(), out.data_ptr(), t, n2 // 2, *constants)
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return _gated(_lib().tm_silu_and_mul, x)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Gemma's GeGLU of x [T, 2 * I] (gate, up) -> gelu(gate, tanh approximation) * up [T, I]; float32."""
    return _gated(_lib().tm_gelu_tanh_and_mul, x)


def clamped_swiglu_and_mul(x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's experts' activation of x [T, 2 * I] (gate, up) -> [T, I]; float32."""
    return _gated(_lib().tm_clamped_swiglu_and_mul, x, alpha, limit)
