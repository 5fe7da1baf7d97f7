"""The triton KV store writes this step's keys and values into the same cache slots as the reference."""

from __future__ import annotations

import pytest
import torch

from tests.triton_setup import DEVICE
from tokenmill_service.worker.kernels.torch_ops import TorchOps
from tokenmill_service.worker.kernels.triton.store_kv import store_kv


@pytest.mark.parametrize(("block_size", "kv_heads", "head_dim"), [(16, 1, 64), (32, 2, 128), (16, 3, 64)])
@pytest.mark.parametrize("tokens", [1, 17])
def test_store_kv_matches_the_reference(block_size: int, kv_heads: int, head_dim: int, tokens: int) -> None:
    gen = torch.Generator().manual_seed(block_size + kv_heads + tokens)
    num_blocks = 8
    # k and v as the attention layer passes them: strided views of one qkv output.
    kv = torch.randn(tokens, 2 * kv_heads * head_dim, generator=gen).to(DEVICE)
    k, v = (t.view(tokens, kv_heads, head_dim) for t in kv.split(kv_heads * head_dim, dim=-1))
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens].to(DEVICE)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    want_k, want_v = torch.zeros(shape, device=DEVICE), torch.zeros(shape, device=DEVICE)
    got_k, got_v = torch.zeros(shape, device=DEVICE), torch.zeros(shape, device=DEVICE)
    TorchOps().store_kv(k, v, want_k, want_v, slots)
    store_kv(k, v, got_k, got_v, slots)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
