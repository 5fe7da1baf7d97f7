"""Rotary embedding of q and k in place (Hugging Face's half rotation), one program per token.

q and k are usually strided views into the fused qkv projection's output; the kernel takes
their strides, so nothing is copied.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# @triton.jit is untyped, and the kernels' parameters stay unannotated (triton reads a parameter's
# annotation to choose how it specialises the kernel), hence their narrow type-ignores.


@triton.jit  # type: ignore[untyped-decorator]
def _rotate_heads(ptr, stride_t, stride_h, row, heads, cos, sin, HEADS_PAD: tl.constexpr, HALF: tl.constexpr):  # type: ignore[no-untyped-def]
    h = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, HALF)
    mask = (h < heads)[:, None]
    first = ptr + row * stride_t + h[:, None] * stride_h + d[None, :]
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + HALF, mask=mask, other=0.0)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(first, (a * cos - b * sin).to(x1.dtype), mask=mask)
    tl.store(first + HALF, (b * cos + a * sin).to(x2.dtype), mask=mask)


@triton.jit  # type: ignore[untyped-decorator]
def _rotary_kernel(  # type: ignore[no-untyped-def]
    q_ptr, k_ptr, positions_ptr, cos_ptr, sin_ptr,
    stride_qt, stride_qh,
    stride_kt, stride_kh,
    stride_cos,
    q_heads, k_heads,
    Q_HEADS_PAD: tl.constexpr, K_HEADS_PAD: tl.constexpr, HALF: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + row)
    d = tl.arange(0, HALF)
    cos = tl.load(cos_ptr + pos * stride_cos + d)[None, :]
    sin = tl.load(sin_ptr + pos * stride_cos + d)[None, :]
    _rotate_heads(q_ptr, stride_qt, stride_qh, row, q_heads, cos, sin, Q_HEADS_PAD, HALF)
    _rotate_heads(k_ptr, stride_kt, stride_kh, row, k_heads, cos, sin, K_HEADS_PAD, HALF)


def rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """As ``Ops.rotary``, in place: q [T, H, D] and k [T, KV, D] (last dim contiguous) are returned rotated."""
    tokens, q_heads, head_dim = q.shape
    half = head_dim // 2
    if half & (half - 1):
        raise ValueError(f"the triton rotary kernel needs a power-of-two head_dim / 2, not {half}")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride() != cos.stride():
        raise ValueError("the triton rotary kernel needs the last dimension of q, k, cos and sin contiguous")
    if tokens:
        _rotary_kernel[(tokens,)](
            q, k, positions, cos, sin,
            q.stride(0), q.stride(1),
            k.stride(0), k.stride(1),
            cos.stride(0),
            q_heads, k.shape[1],
            Q_HEADS_PAD=triton.next_power_of_2(q_heads), K_HEADS_PAD=triton.next_power_of_2(k.shape[1]), HALF=half,
        )  # fmt: skip
    return q, k
