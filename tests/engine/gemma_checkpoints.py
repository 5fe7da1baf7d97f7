"""Tiny random Gemma 2 and Gemma 3 checkpoints made from transformers configs, and GGUFs of them written
as llama.cpp's convert_hf_to_gguf.py writes Gemma (its ``gemma2`` / ``gemma3`` metadata keys and tensor
names, every norm weight shifted by +1, no q/k permutation, no ``output.weight``: the head is tied)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import torch

from tests.engine.test_gguf_loader import _randomize

WINDOW = 8  # tokens: prompts of three windows and more stay short
PROMPT = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(2)).tolist()  # five windows

COMMON = dict(  # noqa: C408 - keyword names as in the transformers configs
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,  # a head the native attention kernel takes (hidden / heads is 16)
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    sliding_window=WINDOW,
)


def gemma2(query_pre_attn_scalar: int = 48, head_dim: int = 64) -> Any:
    """Two layers (0 local, 1 global), soft caps small enough to bite on random weights."""
    import transformers

    config = transformers.Gemma2Config(
        **{**COMMON, "head_dim": head_dim},
        num_hidden_layers=2,
        query_pre_attn_scalar=query_pre_attn_scalar,
        attn_logit_softcapping=10.0,
        final_logit_softcapping=5.0,
    )
    torch.manual_seed(0)
    model = transformers.Gemma2ForCausalLM(config)
    _randomize(model, seed=1)  # norms near 1 (so 1 + w near 2), every weight random
    return model.eval()


def gemma3(head_dim: int = 64) -> Any:
    """Six layers, Gemma 3's pattern (layers 0-4 local, 5 global, as llama.cpp assumes for a GGUF);
    local rotary base 10^4, global 10^6 with linear scaling (factor 4). ``head_dim`` 256: Gemma 3 1B's
    (and 4B's, 12B's)."""
    import transformers

    rope = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0},
    }
    config = transformers.Gemma3TextConfig(
        **{**COMMON, "head_dim": head_dim}, num_hidden_layers=6, query_pre_attn_scalar=64, rope_parameters=rope
    )
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(config)
    _randomize(model, seed=1)
    return model.eval()


_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _gguf_name(name: str) -> str:
    if name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if name == "model.norm.weight":
        return "output_norm.weight"
    parts = name.split(".")  # model.layers.N.<module...>.weight
    return f"blk.{parts[2]}.{_LAYER_NAMES['.'.join(parts[3:-1])]}.weight"


def convert_gemma_to_gguf(model: Any, path: Path) -> None:
    """A float32 GGUF of a Gemma 2 or 3 transformers model, as llama.cpp's converter writes it."""
    cfg = model.config
    arch = "gemma2" if cfg.model_type == "gemma2" else "gemma3"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_sliding_window(cfg.sliding_window)
    if arch == "gemma2":  # no rope keys: llama.cpp's default base (10^4) is transformers' too
        writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    else:
        full, local = cfg.rope_parameters["full_attention"], cfg.rope_parameters["sliding_attention"]
        writer.add_rope_freq_base(full["rope_theta"])
        writer.add_rope_freq_base_swa(local["rope_theta"])
        if full.get("rope_type") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(full["factor"])
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied: llama.cpp's converter skips it
        data = tensor.detach().float()
        if name.endswith("norm.weight"):
            data = data + 1  # Gemma's RMSNorm multiplies by (1 + w): the converter stores 1 + w
        writer.add_tensor(_gguf_name(name), data.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
