"""RMSNorm fused with the residual add: one program per token row, the whole row in one tile."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# @triton.jit is untyped, and the kernels' parameters stay unannotated (triton reads a parameter's
# annotation to choose how it specialises the kernel), hence their narrow type-ignores.


@triton.jit  # type: ignore[untyped-decorator]
def _rms_norm_kernel(  # type: ignore[no-untyped-def]
    x_ptr, residual_ptr, weight_ptr, out_ptr, h_ptr,
    stride_x, stride_r, stride_o, stride_h,
    dim, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    h = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        h = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0) + h
    tl.store(h_ptr + row * stride_h + cols, h, mask=mask)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / dim + eps)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (h * rstd * weight).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None, out_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """As ``Ops.rms_norm``: h = x + residual in float32; returns (rmsnorm(h) * weight in out_dtype, h)."""
    tokens, dim = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    if residual is not None and residual.stride(-1) != 1:
        residual = residual.contiguous()
    out = torch.empty((tokens, dim), dtype=out_dtype, device=x.device)
    h = torch.empty((tokens, dim), dtype=torch.float32, device=x.device)
    if tokens:
        _rms_norm_kernel[(tokens,)](
            x, residual if residual is not None else x, weight, out, h,  # residual: never read without HAS_RESIDUAL
            x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0), h.stride(0),
            dim, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(dim),
        )  # fmt: skip
    return out, h
