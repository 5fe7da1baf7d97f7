"""Attention sinks (gpt-oss: a learned logit per head in each query's softmax denominator, weighing no
value) in every backend (the torch reference, the native CPU kernel, triton under its interpreter)
against plain float64 attention, with and without a sliding window; and a query's result bitwise the
same alone, in a crowd and inside a prefill chunk."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_sliding_window_attention import (
    BACKENDS,
    HEAD_DIM,
    HEADS,
    KV_HEADS,
    NEEDS_NATIVE,
    Sequences,
    make_ops,
)
from tests.triton_setup import DEVICE
from tokenmill_service.worker.kernels.attention_metadata import build_attention_metadata
from tokenmill_service.worker.kernels.attention_params import AttentionParams

# Sinks around the scores' scale, one far above them (its head's outputs shrink toward zero).
SINKS = torch.tensor([0.5, -1.0, 2.0, 6.0])


def attend(
    data: Sequences, seqs: list[int], query_lens: list[int], starts: list[int], window: int | None
) -> torch.Tensor:
    tables = [data.tables[s] for s in seqs]
    meta = build_attention_metadata(query_lens, starts, tables, data.k_cache, data.v_cache)
    q = torch.cat([data.q[s][a : a + n] for s, n, a in zip(seqs, query_lens, starts)]).to(DEVICE)
    params = AttentionParams(HEAD_DIM**-0.5, window, sinks=SINKS.to(DEVICE))
    out = data.ops.attention(q, data.k_cache[0], data.v_cache[0], meta, params)
    return out.cpu()


def reference(data: Sequences, seq: int, position: int, window: int | None) -> torch.Tensor:
    """transformers' eager gpt-oss attention for one query [H, D], in float64: the sink a last column
    of the softmax, dropped before the values."""
    first = 0 if window is None else max(0, position - window + 1)
    k = data.k[seq][first : position + 1].double().repeat_interleave(HEADS // KV_HEADS, dim=1)
    v = data.v[seq][first : position + 1].double().repeat_interleave(HEADS // KV_HEADS, dim=1)
    scores = torch.einsum("hd,khd->hk", data.q[seq][position].double(), k) * HEAD_DIM**-0.5
    probs = torch.softmax(torch.cat((scores, SINKS.double()[:, None]), dim=-1), -1)[:, :-1]
    return torch.einsum("hk,khd->hd", probs, v).float()


@pytest.mark.parametrize(
    ("backend", "window"), [("torch", None), ("torch", 8), pytest.param("native", 8, marks=NEEDS_NATIVE), ("triton", 8)]
)
def test_sinks_match_plain_attention_with_a_sink_column(backend: str, window: int | None) -> None:
    """Two decodes, a prefill chunk with cached context and a fresh prompt, in one step."""
    data = Sequences(make_ops(backend), [90, 20, 60, 24])
    seqs, query_lens, starts = [0, 1, 2, 3], [1, 1, 20, 24], [89, 19, 40, 0]
    out = attend(data, seqs, query_lens, starts, window)
    want = torch.cat(
        [
            torch.stack([reference(data, s, a + j, window) for j in range(n)])
            for s, n, a in zip(seqs, query_lens, starts)
        ]
    )
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_query_with_sinks_is_bitwise_the_same_alone_in_a_crowd_and_in_a_prefill(backend: str) -> None:
    data = Sequences(make_ops(backend), [40, 30, 50], seed=1)
    prefill = attend(data, [0], [40], [0], 8)
    chunked = torch.cat([attend(data, [0], [17], [0], 8), attend(data, [0], [23], [17], 8)])
    assert torch.equal(chunked, prefill)
    for position in (0, 7, 8, 16, 31, 39):
        alone = attend(data, [0], [1], [position], 8)
        crowd = attend(data, [1, 0, 2], [1, 1, 20], [29, position, 30], 8)
        assert torch.equal(alone[0], prefill[position]), position
        assert torch.equal(crowd[1], prefill[position]), position
