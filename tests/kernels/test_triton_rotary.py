"""The triton rotary kernel rotates q and k, strided views of one qkv output, as the torch reference does."""

from __future__ import annotations

import pytest
import torch

from tests.triton_setup import DEVICE
from tokenmill_service.worker.kernels.torch_ops import TorchOps
from tokenmill_service.worker.kernels.triton.rotary import rotary
from tokenmill_service.worker.layers.rotary import RotaryEmbedding


@pytest.mark.parametrize(("head_dim", "heads", "kv_heads"), [(64, 4, 4), (128, 6, 2), (64, 8, 1)])
@pytest.mark.parametrize("tokens", [1, 17])
def test_rotary_matches_the_reference_in_place(head_dim: int, heads: int, kv_heads: int, tokens: int) -> None:
    gen = torch.Generator().manual_seed(head_dim + heads + tokens)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(DEVICE)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)
    positions = torch.randint(0, 500, (tokens,), generator=gen).to(DEVICE)
    tables = RotaryEmbedding(head_dim, 512, 10000.0, None, TorchOps()).to(DEVICE)
    want_q, want_k = TorchOps().rotary(q, k, positions, tables.cos, tables.sin)
    got_q, got_k = rotary(q, k, positions, tables.cos, tables.sin)
    torch.testing.assert_close(got_q, want_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_k, want_k, rtol=1e-6, atol=1e-6)
    assert got_q.data_ptr() == q.data_ptr()  # rotated where the qkv projection wrote it
