"""The packed q/k/v and gate/up projections compute what the separate ones do."""

from __future__ import annotations

import copy

import pytest
import torch

from tokenmill_service.models.attention_metadata import AttentionMetadata
from tokenmill_service.models.config import ModelConfig
from tokenmill_service.models.llama import LlamaForCausalLM, fuse_projections


@pytest.mark.parametrize("bias", [False, True], ids=["llama", "qwen2-bias"])
def test_fused_model_gives_the_same_logits(bias: bool) -> None:
    torch.manual_seed(0)
    config = ModelConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        max_position_embeddings=64,
        attention_bias=bias,
    )
    model = LlamaForCausalLM(config).eval()
    for p in model.parameters():  # biases start at zero: make them count
        torch.nn.init.normal_(p, std=0.2)
    fused = fuse_projections(copy.deepcopy(model))
    assert fused.model.layers[0].self_attn.qkv_proj is not None
    assert not hasattr(fused.model.layers[0].self_attn, "q_proj")
    ids = torch.randint(0, 97, (11,))
    pos = torch.arange(11)
    meta = AttentionMetadata.no_cache([11])
    with torch.no_grad():
        want = model.compute_logits(model(ids, pos, meta))
        got = fused.compute_logits(fused(ids, pos, meta))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert fuse_projections(fused) is fused  # a second call changes nothing
