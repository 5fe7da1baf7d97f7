"""The native CPU attention (native/paged_attention.cpp, behind ops/native_cpu_ops.py) against the
plain-torch reference (ops/torch_ops.py), and its batch invariance, on random paged caches."""

from __future__ import annotations

import pytest
import torch

from tokenmill_service.native import paged_attention
from tokenmill_service.ops.attention_metadata import build_attention_metadata
from tokenmill_service.ops.native_cpu_ops import NativeCpuOps, native_attention_serves
from tokenmill_service.ops.torch_ops import TorchOps

pytestmark = pytest.mark.skipif(
    paged_attention.unavailable_reason() is not None,
    reason=f"native kernel unavailable: {paged_attention.unavailable_reason()}",
)
BLOCK = 16


def _setup(heads: int, kv_heads: int, head_dim: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (1, 96, BLOCK, kv_heads, head_dim)  # one layer's worth, as the runner allocates them
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def _tables(lengths: list[int]) -> list[list[int]]:
    """Scattered, non-overlapping block tables (reversed order), one per sequence."""
    tables, next_block = [], 95
    for n in lengths:
        count = -(-n // BLOCK)
        tables.append(list(range(next_block, next_block - count, -1)))
        next_block -= count
    return tables


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 128), (8, 2, 64)])
def test_native_attention_matches_the_torch_reference_on_a_mixed_step(heads: int, kv_heads: int, head_dim: int) -> None:
    k_cache, v_cache = _setup(heads, kv_heads, head_dim)
    # Two decodes (long and short context), a prefill chunk with cached context, a fresh prefill.
    query_lens, starts = [1, 1, 37, 300], [700, 3, 40, 0]
    tables = _tables([s + n for s, n in zip(starts, query_lens)])
    meta = build_attention_metadata(query_lens, starts, tables, k_cache, v_cache)
    q = torch.randn(sum(query_lens), heads, head_dim, generator=torch.Generator().manual_seed(1))
    scale = head_dim**-0.5
    got = NativeCpuOps().attention(q, k_cache[0], v_cache[0], meta, scale)
    want = TorchOps().attention(q, k_cache[0], v_cache[0], meta, scale)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


def test_a_querys_result_is_the_same_alone_in_a_crowd_and_in_a_prefill_chunk() -> None:
    k_cache, v_cache = _setup(9, 3, 64)
    ops, scale = NativeCpuOps(), 0.125
    tables = _tables([200, 50, 130])
    q = torch.randn(200, 9, 64, generator=torch.Generator().manual_seed(2))

    def run(query_lens: list[int], starts: list[int], rows: list[torch.Tensor], seqs: list[int]) -> torch.Tensor:
        meta = build_attention_metadata(query_lens, starts, [tables[s] for s in seqs], k_cache, v_cache)
        return ops.attention(torch.cat(rows), k_cache[0], v_cache[0], meta, scale)

    prefill = run([200], [0], [q], [0])  # sequence 0's 200 tokens in one chunk
    other = torch.randn(60, 9, 64)
    for position in (0, 15, 16, 130, 199):
        alone = run([1], [position], [q[position : position + 1]], [0])
        crowd = run([1, 1, 58], [position, 49, 72], [q[position : position + 1], other[:1], other[2:]], [0, 1, 2])
        assert torch.equal(alone[0], prefill[position]), position
        assert torch.equal(crowd[0], prefill[position]), position
    # A chunk of the prefill with cached context gives the same rows as the whole prefill.
    chunk = run([80], [100], [q[100:180]], [0])
    assert torch.equal(chunk, prefill[100:180])


def test_the_loader_says_where_native_attention_cannot_serve() -> None:
    assert native_attention_serves("cpu", torch.float32, 64) is None
    assert "float32 KV cache" in str(native_attention_serves("cpu", torch.bfloat16, 64))
    assert "head_dim 64 or 128" in str(native_attention_serves("cpu", torch.float32, 80))
    assert "on the CPU" in str(native_attention_serves("cuda:0", torch.float32, 64))
