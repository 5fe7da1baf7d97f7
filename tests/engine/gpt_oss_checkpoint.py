"""A tiny random gpt-oss checkpoint made from transformers' GptOssConfig: sliding-window layers of 8 keys
alternating with full ones, 4 experts top-2, YaRN, attention sinks, biases everywhere, the clamped SwiGLU
(every parameter random: sinks and biases count)."""

from __future__ import annotations

from typing import Any

import torch

from tests.engine.test_gguf_loader import _randomize

WINDOW = 8
PROMPT = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(2)).tolist()
ROPE = {
    "rope_type": "yarn",
    "factor": 4.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 64,
    "rope_theta": 150000.0,
}


def hf_gpt_oss(layers: int = 2) -> Any:
    import transformers

    config = transformers.GptOssConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,  # a head the native attention kernel takes
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=WINDOW,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_parameters=ROPE,
    )
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config)
    _randomize(model, seed=1)
    return model.eval()
