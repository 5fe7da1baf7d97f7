"""Sliding-window attention and attention logit soft-capping in every backend (the torch reference, the
native CPU kernel, triton under its interpreter) against a plain float64 attention over dense keys:
a query at p sees p - window + 1 .. p, scores s become tanh(s / cap) * cap. Contexts run to three
windows and more, in decode tokens and prefill chunks (fresh and with cached context) side by side;
and a query's result is bitwise the same alone, in a crowd, and inside a prefill chunk.
"""

from __future__ import annotations

import pytest
import torch

from tests.triton_setup import DEVICE  # before anything imports triton: its interpreter without a GPU
from tokenmill_service.worker.device import probe_device
from tokenmill_service.worker.kernels.attention_metadata import NULL_BLOCK, build_attention_metadata
from tokenmill_service.worker.kernels.attention_params import AttentionParams
from tokenmill_service.worker.kernels.cpu.ops import NativeCpuOps
from tokenmill_service.worker.kernels.interface import Ops
from tokenmill_service.worker.kernels.torch_ops import TorchOps
from tokenmill_service.worker.kernels.triton import TritonOps

BLOCK = 16
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 64
NATIVE_MISSING = probe_device("cpu").native("paged_attention", "elementwise")
NEEDS_NATIVE = pytest.mark.skipif(NATIVE_MISSING is not None, reason=f"native kernels unavailable: {NATIVE_MISSING}")
BACKENDS = ["torch", pytest.param("native", marks=NEEDS_NATIVE), "triton"]


def make_ops(name: str) -> Ops:
    return {"torch": TorchOps, "native": NativeCpuOps, "triton": TritonOps}[name]()


class Sequences:
    """Dense random keys, values and queries of sequences of ``lengths`` tokens, stored in one layer's
    paged cache of the backend's layout through its ``store_kv`` (block tables scattered, reversed)."""

    def __init__(self, ops: Ops, lengths: list[int], seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.ops, self.lengths = ops, lengths
        self.k = [torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen) for n in lengths]
        self.v = [torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen) for n in lengths]
        self.q = [torch.randn(n, HEADS, HEAD_DIM, generator=gen) * 2 for n in lengths]
        blocks = sum(-(-n // BLOCK) for n in lengths) + 1
        self.tables, next_block = [], blocks - 1
        for n in lengths:
            count = -(-n // BLOCK)
            self.tables.append(list(range(next_block, next_block - count, -1)))
            next_block -= count
        k_shape, v_shape = ops.kv_cache_layout.shapes(1, blocks, BLOCK, KV_HEADS, HEAD_DIM)
        self.k_cache, self.v_cache = torch.zeros(k_shape, device=DEVICE), torch.zeros(v_shape, device=DEVICE)
        for i, n in enumerate(lengths):
            slots = torch.tensor([self.tables[i][p // BLOCK] * BLOCK + p % BLOCK for p in range(n)])
            ops.store_kv(self.k[i].to(DEVICE), self.v[i].to(DEVICE), self.k_cache[0], self.v_cache[0], slots.to(DEVICE))

    def attend(
        self, seqs: list[int], query_lens: list[int], starts: list[int], window: int | None, softcap: float | None
    ) -> torch.Tensor:
        """Sequence ``seqs[i]``'s queries at ``starts[i]`` .. + ``query_lens[i]``, as one step."""
        tables = [self.tables[s] for s in seqs]
        meta = build_attention_metadata(query_lens, starts, tables, self.k_cache, self.v_cache)
        q = torch.cat([self.q[s][a : a + n] for s, n, a in zip(seqs, query_lens, starts)]).to(DEVICE)
        params = AttentionParams(HEAD_DIM**-0.5, window, softcap)
        return self.ops.attention(q, self.k_cache[0], self.v_cache[0], meta, params).cpu()

    def reference(self, seq: int, position: int, window: int | None, softcap: float | None) -> torch.Tensor:
        """Plain attention of one query [H, D] over its visible keys, in float64."""
        first = 0 if window is None else max(0, position - window + 1)
        k = self.k[seq][first : position + 1].double().repeat_interleave(HEADS // KV_HEADS, dim=1)
        v = self.v[seq][first : position + 1].double().repeat_interleave(HEADS // KV_HEADS, dim=1)
        scores = torch.einsum("hd,khd->hk", self.q[seq][position].double(), k) * HEAD_DIM**-0.5
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        return torch.einsum("hk,khd->hd", torch.softmax(scores, -1), v).float()


# (window, softcap): a window alone, small and spanning blocks; soft-capping alone; both (triton, whose
# interpreter is slow, runs both at once only).
SETTINGS = [(8, None), (40, None), (None, 5.0), (16, 5.0)]
CASES = [
    *(pytest.param("torch", w, c) for w, c in SETTINGS),
    *(pytest.param("native", w, c, marks=NEEDS_NATIVE) for w, c in SETTINGS),
    pytest.param("triton", 16, 5.0),
]


@pytest.mark.parametrize(("backend", "window", "softcap"), CASES)
def test_windowed_soft_capped_attention_matches_plain_attention(
    backend: str, window: int | None, softcap: float | None
) -> None:
    """Two decodes (one deep past its window), a prefill chunk with cached context and a fresh
    prompt of three windows and more, in one step."""
    data = Sequences(make_ops(backend), [150, 20, 90, 56])
    seqs, query_lens, starts = [0, 1, 2, 3], [1, 1, 30, 56], [149, 19, 60, 0]
    out = data.attend(seqs, query_lens, starts, window, softcap)
    want = torch.cat(
        [
            torch.stack([data.reference(s, a + j, window, softcap) for j in range(n)])
            for s, n, a in zip(seqs, query_lens, starts)
        ]
    )
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_windowed_query_is_bitwise_the_same_alone_in_a_crowd_and_in_a_prefill(backend: str) -> None:
    """Sequence 0's queries, each as a decode token alone and beside others, against its whole
    prompt prefilled in one chunk and in two (the second with cached context); window 8, capped."""
    window, softcap = 8, 5.0
    data = Sequences(make_ops(backend), [70, 30, 50], seed=1)
    prefill = data.attend([0], [70], [0], window, softcap)
    chunked = torch.cat([data.attend([0], [33], [0], window, softcap), data.attend([0], [37], [33], window, softcap)])
    assert torch.equal(chunked, prefill)
    for position in (0, 7, 8, 9, 15, 16, 17, 31, 32, 47, 63, 64, 69):
        alone = data.attend([0], [1], [position], window, softcap)
        crowd = data.attend([1, 0, 2], [1, 1, 20], [29, position, 30], window, softcap)
        assert torch.equal(alone[0], prefill[position]), position
        assert torch.equal(crowd[1], prefill[position]), position


def test_triton_over_several_splits_before_the_window() -> None:
    """Splits of 64 keys: a decode (two passes, the splits wholly before the window left empty) and a
    prefill (one pass, starting at the window's split) give plain attention, and the same bits."""
    from tokenmill_service.worker.kernels.triton.attention import paged_attention

    data = Sequences(TritonOps(), [300], seed=2)
    outs = []
    for query_lens, starts in (([1], [299]), ([20], [280])):
        meta = build_attention_metadata(query_lens, starts, data.tables, data.k_cache, data.v_cache)
        q = data.q[0][starts[0] : starts[0] + query_lens[0]].to(DEVICE)
        k, v = data.k_cache[0], data.v_cache[0]
        outs.append(paged_attention(q, k, v, meta, AttentionParams(HEAD_DIM**-0.5, window=70), split_keys=64).cpu())
        want = torch.stack([data.reference(0, starts[0] + j, 70, None) for j in range(query_lens[0])])
        torch.testing.assert_close(outs[-1], want, atol=2e-5, rtol=1e-4)
    assert torch.equal(outs[0][0], outs[1][-1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_blocks_dropped_behind_every_window_are_never_weighed(backend: str) -> None:
    """The KV cache frees a sequence's blocks wholly before its next query's window (NULL_BLOCK in its
    table, read as block 0): the same bits as with every block there, whatever block 0 holds."""
    window = 20
    data = Sequences(make_ops(backend), [150, 90], seed=3)
    gen = torch.Generator().manual_seed(4)
    for cache in (data.k_cache, data.v_cache):  # block 0 is no sequence's: fill it with other keys and values
        cache[0][0].copy_(torch.randn(cache[0][0].shape, generator=gen) * 10)
    seqs, query_lens, starts = [0, 1], [1, 30], [149, 60]
    kept = data.attend(seqs, query_lens, starts, window, None)
    # The first visible keys: 130 (blocks 0-7 wholly before it) and 41 (blocks 0-1).
    for seq, dropped in ((0, 8), (1, 2)):
        data.tables[seq] = [NULL_BLOCK] * dropped + data.tables[seq][dropped:]
    assert torch.equal(data.attend(seqs, query_lens, starts, window, None), kept)
    want = torch.stack(
        [data.reference(0, 149, window, None), *(data.reference(1, 60 + j, window, None) for j in range(30))]
    )
    torch.testing.assert_close(kept, want, atol=2e-5, rtol=1e-4)
