"""SiLU-and-mul of the MLP: [T, 2I] (gate, up) -> silu(gate) * up, [T, I], float32 inside."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# @triton.jit is untyped, and the kernels' parameters stay unannotated (triton reads a parameter's
# annotation to choose how it specialises the kernel), hence their narrow type-ignores.


BLOCK = 1024


@triton.jit  # type: ignore[untyped-decorator]
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, inter, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    tokens, width = x.shape
    inter = width // 2
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty((tokens, inter), dtype=x.dtype, device=x.device)
    block = min(BLOCK, triton.next_power_of_2(inter))
    if tokens:
        _silu_and_mul_kernel[(tokens, triton.cdiv(inter, block))](
            x, out, x.stride(0), out.stride(0), inter, BLOCK=block
        )
    return out
