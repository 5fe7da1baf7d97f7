"""Paged causal attention on the CPU, one query at a time in a fixed order (paged_attention.cpp).

The key cache is laid out for it: each block transposed, [kv_heads, head_dim, block_size] in the
memory of a [block_size, kv_heads, head_dim] block, written by ``store_keys``. Only this module
reads and writes it (the same total size, so the engine's block accounting is unchanged)."""

from __future__ import annotations

import ctypes
import functools

import torch

from tokenmill_service.native import build

HEAD_DIMS = (64, 128)


@functools.cache
def _lib() -> ctypes.CDLL:
    lib = build.load("paged_attention")
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.tm_paged_attention.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, i64, ptr, ptr, ptr, i64]
    lib.tm_paged_attention.argtypes += [ctypes.c_float, ptr, ctypes.c_int]
    lib.tm_paged_attention.restype = ctypes.c_int
    lib.tm_store_keys.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, i64]
    lib.tm_store_keys.restype = None
    return lib


def unavailable_reason() -> str | None:
    return build.unavailable_reason("paged_attention")


def store_keys(k: torch.Tensor, k_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Writes k [T, KV, D] (float32, rows may be strided) into its slots of the transposed key cache."""
    t, kv_heads, head_dim = k.shape
    assert k.stride(2) == 1 and k.stride(1) == head_dim and k_cache.is_contiguous()
    _lib().tm_store_keys(
        k.data_ptr(), k.stride(0), t, kv_heads, head_dim, slot_mapping.contiguous().data_ptr(),
        k_cache.data_ptr(), k_cache.shape[1],
    )  # fmt: skip


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    positions: torch.Tensor,
    seq_of_token: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [T, H, D] float32 -> [T, H, D]: token i (at ``positions[i]`` of sequence ``seq_of_token[i]``)
    attends over keys 0..positions[i] of that sequence, found through ``block_tables`` [S, W] in
    the caches [blocks, block_size, KV, D] (float32, contiguous; this step's keys already stored,
    the keys by ``store_keys``)."""
    t, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    q = q.contiguous()
    out = torch.empty_like(q)
    if t:
        rc = _lib().tm_paged_attention(
            q.data_ptr(), t, heads, kv_heads, head_dim,
            k_cache.data_ptr(), v_cache.data_ptr(), block_size,
            positions.data_ptr(), seq_of_token.data_ptr(), block_tables.data_ptr(), block_tables.shape[1],
            scale, out.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        if rc:
            raise ValueError(f"native attention takes head_dim in {HEAD_DIMS} and whole groups of query heads")
    return out
