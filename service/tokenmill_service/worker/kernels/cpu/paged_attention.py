"""Paged causal attention on the CPU, each query in its own fixed order (paged_attention.cpp).

The key cache is laid out for it: each block transposed, [blocks, kv_heads, head_dim, block_size]
(the native backend's ``KVCacheLayout``), written by ``store_keys``. Only this module reads and
writes it (the same size as the values' [blocks, block_size, kv_heads, head_dim]). The
caches are float32 or float16 (``--kv-cache-dtype float16``: stored rounded to nearest, read back
exactly as float32; the arithmetic is the same)."""

from __future__ import annotations

import ctypes

import torch

from tokenmill_service.worker.kernels.cpu import build

HEAD_DIMS = (64, 128, 256)
CACHE_DTYPES = {torch.float32: "", torch.float16: "_f16"}  # the kernels' symbol suffixes


def _lib() -> ctypes.CDLL:
    return build.load("paged_attention")  # its functions typed from abi.py


def symbol(name: str, cache_dtype: torch.dtype) -> str:
    """The kernel ``name`` (tm_paged_attention, tm_store_keys, tm_store_values) for caches of ``cache_dtype``."""
    if cache_dtype not in CACHE_DTYPES:
        raise ValueError(f"native attention reads float32 or float16 caches, not {cache_dtype}")
    return name + CACHE_DTYPES[cache_dtype]


def unavailable_reason() -> str | None:
    return build.unavailable_reason("paged_attention")


def store_keys(k: torch.Tensor, k_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Writes k [T, KV, D] (float32, rows may be strided) into its slots of the transposed key cache
    [blocks, KV, D, block_size]."""
    t, kv_heads, head_dim = k.shape
    assert k.dtype == torch.float32 and k.stride(2) == 1 and k.stride(1) == head_dim and k_cache.is_contiguous()
    getattr(_lib(), symbol("tm_store_keys", k_cache.dtype))(
        k.data_ptr(), k.stride(0), t, kv_heads, head_dim, slot_mapping.contiguous().data_ptr(),
        k_cache.data_ptr(), k_cache.shape[-1],
    )  # fmt: skip


def store_values(v: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Writes v [T, KV, D] (float32, rows may be strided) into its slots of the value cache."""
    t, kv_heads, head_dim = v.shape
    assert v.dtype == torch.float32 and v.stride(2) == 1 and v.stride(1) == head_dim and v_cache.is_contiguous()
    getattr(_lib(), symbol("tm_store_values", v_cache.dtype))(
        v.data_ptr(), v.stride(0), t, kv_heads * head_dim, slot_mapping.contiguous().data_ptr(), v_cache.data_ptr()
    )


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    positions: torch.Tensor,
    seq_of_token: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, H, D] float32 -> [T, H, D]: token i (at ``positions[i]`` of sequence ``seq_of_token[i]``)
    attends over keys 0..positions[i] of that sequence, found through ``block_tables`` [S, W] in
    the caches (keys [blocks, KV, D, block_size], values [blocks, block_size, KV, D]; float32 or
    float16, contiguous; this step's keys and values already stored by ``store_keys`` and
    ``store_values``). ``window``: token i sees only keys positions[i] - window + 1 .. positions[i];
    ``softcap``: each scaled score s becomes tanh(s / softcap) * softcap; ``sinks`` [H] float32: head
    h's logit in each of its queries' softmax denominators (gpt-oss's attention sinks)."""
    t, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = v_cache.shape
    q = q.contiguous()
    out = torch.empty_like(q)
    if t:
        common = (
            q.data_ptr(), t, heads, kv_heads, head_dim,
            k_cache.data_ptr(), v_cache.data_ptr(), block_size,
            positions.data_ptr(), seq_of_token.data_ptr(), block_tables.data_ptr(), block_tables.shape[1],
            scale,
        )  # fmt: skip
        if window is None and softcap is None and sinks is None:
            kernel = getattr(_lib(), symbol("tm_paged_attention", k_cache.dtype))
            rc = kernel(*common, out.data_ptr(), torch.get_num_threads())
        else:
            if window is not None and window < 1 or softcap is not None and softcap <= 0:
                raise ValueError(f"a window is at least 1 key and a soft cap above 0, not {window} and {softcap}")
            if sinks is not None:
                sinks = sinks.float().contiguous()
                if sinks.shape != (heads,):
                    raise ValueError(f"attention sinks are one logit per head ({heads}), not {tuple(sinks.shape)}")
            kernel = getattr(_lib(), symbol("tm_paged_attention_window", k_cache.dtype))
            sink_ptr = None if sinks is None else sinks.data_ptr()
            rc = kernel(*common, window or 0, softcap or 0.0, sink_ptr, out.data_ptr(), torch.get_num_threads())
        if rc:
            raise ValueError(f"native attention takes head_dim in {HEAD_DIMS} and whole groups of query heads")
    return out
