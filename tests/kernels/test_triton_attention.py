"""The triton paged attention matches the torch reference on mixed batches, and a query's result does
not depend on the batch around it or on whether it came in a prefill chunk or as a decode token.

Block tables are shuffled (and padded with block 0, which belongs to another sequence); context
lengths are not multiples of the block size nor of the split size (64 here, to get several splits
from short contexts; one test keeps the default 256).
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.triton_setup import DEVICE
from tokenmill_service.worker.kernels.attention_metadata import build_attention_metadata
from tokenmill_service.worker.kernels.attention_params import AttentionParams
from tokenmill_service.worker.kernels.torch_ops import TorchOps
from tokenmill_service.worker.kernels.triton.attention import paged_attention

SPLIT = 64
# (head_dim, query heads, kv heads, block size): GQA ratios 1, 3 and 8.
SHAPES = [(64, 4, 4, 16), (128, 6, 2, 32), (64, 8, 1, 16), (128, 3, 1, 32)]


class Batch:
    """Random caches and queries for sequences adding ``query_lens`` tokens after ``starts`` cached ones."""

    def __init__(self, shape: tuple[int, int, int, int], query_lens: list[int], starts: list[int], seed: int) -> None:
        head_dim, heads, kv_heads, block_size = shape
        rng = random.Random(seed)
        gen = torch.Generator().manual_seed(seed)
        need = [-(-(n + s) // block_size) for n, s in zip(query_lens, starts)]
        ids = list(range(1, sum(need) + 1))
        rng.shuffle(ids)
        self.tables = [[ids.pop() for _ in range(b)] for b in need]
        cache_shape = (1, sum(need) + 1, block_size, kv_heads, head_dim)
        self.k_cache = torch.randn(cache_shape, generator=gen).to(DEVICE)
        self.v_cache = torch.randn(cache_shape, generator=gen).to(DEVICE)
        self.q = torch.randn(sum(query_lens), heads, head_dim, generator=gen).to(DEVICE)
        self.query_lens, self.starts = query_lens, starts
        self.params = AttentionParams(head_dim**-0.5)

    def run(self, split: int = SPLIT) -> tuple[torch.Tensor, torch.Tensor]:
        meta = build_attention_metadata(self.query_lens, self.starts, self.tables, self.k_cache, self.v_cache)
        k, v = self.k_cache[0], self.v_cache[0]
        want = TorchOps().attention(self.q, k, v, meta, self.params)
        return paged_attention(self.q, k, v, meta, self.params, split_keys=split), want


def mixed(batch_size: int, decodes: int, seed: int) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    lens = [1] * decodes + [rng.randint(2, 24) for _ in range(batch_size - decodes)]
    starts = [rng.randint(0, 150) for _ in lens]
    starts[0] = 130 if decodes else 0  # a decode over three splits / a prefill from nothing
    rng.shuffle(order := list(range(batch_size)))
    return [lens[i] for i in order], [starts[i] for i in order]


# Every shape alone (decode, prefill) and in a mixed batch; batches of 5 and 17 on two shapes (the interpreter is slow).
CASES = [(shape, size, decodes) for shape in SHAPES for size, decodes in [(1, 1), (1, 0), (9, 4)]]
CASES += [(SHAPES[2], 17, 17), (SHAPES[3], 17, 12), (SHAPES[1], 5, 3)]


@pytest.mark.parametrize(("shape", "batch_size", "decodes"), CASES)
def test_attention_matches_the_reference(shape: tuple[int, int, int, int], batch_size: int, decodes: int) -> None:
    got, want = Batch(shape, *mixed(batch_size, decodes, seed=batch_size), seed=decodes).run()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-5)


def test_default_split_size_over_long_contexts() -> None:
    batch = Batch((64, 6, 2, 16), [1, 1, 7], [600, 37, 300], seed=3)
    got, want = batch.run(split=256)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-5)


def test_a_query_gives_the_same_bits_alone_in_any_batch_and_as_prefill_or_decode() -> None:
    shape = (64, 6, 2, 16)
    # Sequence 0 decodes its token at position 140 beside others, then alone ...
    beside = Batch(shape, [1, 9, 1, 3], [140, 20, 77, 0], seed=5)
    alone = Batch(shape, [1], [140], seed=5)
    alone.k_cache, alone.v_cache, alone.tables = beside.k_cache, beside.v_cache, beside.tables[:1]
    alone.q = beside.q[:1].clone()
    got_beside, _ = beside.run()
    got_alone, _ = alone.run()
    assert torch.equal(got_beside[0], got_alone[0])
    # ... and as the last token of a prefill chunk over the same cached prefix.
    chunk = Batch(shape, [5], [136], seed=5)
    chunk.k_cache, chunk.v_cache, chunk.tables = beside.k_cache, beside.v_cache, beside.tables[:1]
    chunk.q = torch.cat((torch.randn(4, 6, 64, device=DEVICE), beside.q[:1]))
    got_chunk, _ = chunk.run()
    assert torch.equal(got_chunk[4], got_alone[0])
