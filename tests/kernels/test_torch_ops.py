"""The torch reference ops (worker/kernels/torch_ops.py) keep the batch-invariance promise on their own: a
query's attention is bit for bit the same decoded alone, decoded beside other sequences, and as a row
of its sequence's prefill. No native kernel is involved, so this runs wherever torch does."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tokenmill_service.worker.kernels.attention_metadata import build_attention_metadata
from tokenmill_service.worker.kernels.attention_params import AttentionParams
from tokenmill_service.worker.kernels.torch_ops import TorchOps

NUM_BLOCKS = 128


def _caches(kv_heads: int, head_dim: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's caches, every slot holding random keys and values."""
    ops = TorchOps()
    gen = torch.Generator().manual_seed(0)
    k_shape, v_shape = ops.kv_cache_layout.shapes(1, NUM_BLOCKS, block, kv_heads, head_dim)
    k_cache, v_cache = torch.zeros(k_shape), torch.zeros(v_shape)
    slots = NUM_BLOCKS * block
    k = torch.randn(slots, kv_heads, head_dim, generator=gen)
    v = torch.randn(slots, kv_heads, head_dim, generator=gen)
    ops.store_kv(k, v, k_cache[0], v_cache[0], torch.arange(slots))
    return k_cache, v_cache


# (4, 2, 64) with blocks of 4 is a tiny Qwen3's attention, where one decoding sequence's scores moved
# by ~1e-6 between a batch of one and a batch of three.
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block"),
    [(4, 2, 64, 4), (4, 2, 64, 16), (9, 3, 64, 16), (8, 2, 128, 16), (4, 4, 16, 4), (8, 1, 64, 16), (6, 2, 32, 8)],
)
@torch.inference_mode()
def test_a_query_is_bitwise_the_same_alone_beside_others_and_in_its_prefill(
    heads: int, kv_heads: int, head_dim: int, block: int
) -> None:
    ops, params = TorchOps(), AttentionParams(head_dim**-0.5)
    k_cache, v_cache = _caches(kv_heads, head_dim, block)
    # Out-of-order tables, none sharing a block; the others' contexts are shorter and longer.
    tables = [list(range(127, 127 - 80 // block, -1)), [3, 1, 7, 0, 5, 2, 8, 4], list(range(9, 9 + 304 // block))]
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(80, heads, head_dim, generator=gen)
    others = torch.randn(150, heads, head_dim, generator=gen)

    def run(query_lens: list[int], starts: list[int], rows: torch.Tensor, seqs: list[int]) -> torch.Tensor:
        meta = build_attention_metadata(query_lens, starts, [tables[s] for s in seqs], k_cache, v_cache)
        return ops.attention(rows, k_cache[0], v_cache[0], meta, params)

    prefill = run([80], [0], q, [0])
    for position in (0, 5, 13, 16, 63, 79):
        row = q[position : position + 1]
        alone = run([1], [position], row, [0])
        crowd = run([1, 1, 1], [9, position, 250], torch.cat((others[:1], row, others[1:2])), [1, 0, 2])
        assert torch.equal(crowd[1], alone[0]), position
        assert torch.equal(alone[0], prefill[position]), position
    # The prefill beside a longer one (more query rows, a second key chunk) and a short one.
    mixed = run([7, 80, 140], [0, 0, 160], torch.cat((others[:7], q, others[:140])), [1, 0, 2])
    assert torch.equal(mixed[7:87], prefill)


def test_the_promise_holds_with_mkl_held_to_its_avx2_code() -> None:
    """The test above and the latent attention's (test_latent_attention.py) in a process whose MKL runs its AVX2
    code (as on an AVX2-only CPU): MKL picks its kernel by a product's shape and its instruction set, and on an
    Intel Xeon both its AVX-512 and its AVX2 code summed 4 query rows in another order than 320 (a decode token's
    attention differed from its prefill's) until every row's sums came from the same 4-row product."""
    env = {**os.environ, "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    if platform.machine().lower() in ("x86_64", "amd64"):  # (a value torch has only on x86)
        env["ATEN_CPU_CAPABILITY"] = "avx2"
    name = "test_a_query_is_bitwise_the_same_alone_beside_others_and_in_its_prefill"
    tests = [f"{__file__}::{name}", f"{Path(__file__).parent / 'test_latent_attention.py'}::{name}"]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests], env=env, capture_output=True,
        text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-3000:]
