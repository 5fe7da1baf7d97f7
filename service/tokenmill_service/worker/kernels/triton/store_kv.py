"""This step's keys and values into their slots of one layer's paged cache, one program per token."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# @triton.jit is untyped, and the kernels' parameters stay unannotated (triton reads a parameter's
# annotation to choose how it specialises the kernel), hence their narrow type-ignores.


@triton.jit  # type: ignore[untyped-decorator]
def _store_kv_kernel(  # type: ignore[no-untyped-def]
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh,
    stride_vt, stride_vh,
    stride_cb, stride_co, stride_ch,
    kv_heads, head_dim, block_size,
    HEADS_PAD: tl.constexpr, D_PAD: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + row)
    h = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, D_PAD)[None, :]
    mask = (h < kv_heads) & (d < head_dim)
    dst = (slot // block_size) * stride_cb + (slot % block_size) * stride_co + h * stride_ch + d
    k = tl.load(k_ptr + row * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + row * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """As ``Ops.store_kv``: k, v [T, KV, D] (last dim contiguous) -> caches [num_blocks, block_size, KV, D]."""
    tokens, kv_heads, head_dim = k.shape
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        k, v = k.contiguous(), v.contiguous()
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("the triton store_kv kernel needs K and V caches of one layout, last dim contiguous")
    if tokens:
        _store_kv_kernel[(tokens,)](
            k, v, k_cache, v_cache, slot_mapping,
            k.stride(0), k.stride(1),
            v.stride(0), v.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            kv_heads, head_dim, k_cache.shape[1],
            HEADS_PAD=triton.next_power_of_2(kv_heads), D_PAD=triton.next_power_of_2(head_dim),
        )  # fmt: skip
