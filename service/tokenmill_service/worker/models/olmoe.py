"""OLMoE (transformers' modeling_olmoe.py): Llama attention whose q and k are RMS-normalized over the
whole projection (all heads together, unlike Qwen3's per-head norm), and every layer's MLP a mixture
of ``num_experts`` experts, the top ``num_experts_per_tok`` by softmax, renormalized only when
``norm_topk_prob`` (OLMoE-1B-7B does not). Each expert is ``intermediate_size`` wide.

The norms span every head, so a rank holding some heads cannot apply them alone: tensor parallelism
is refused for this family (a ValueError at load, naming why). ``clip_qkv`` is refused too.
llama.cpp's "olmoe" GGUFs name the norms ``attn_q_norm`` / ``attn_k_norm`` and stack the experts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from tokenmill_service.worker.layers.norm import RMSNorm
from tokenmill_service.worker.models.config import ModelConfig
from tokenmill_service.worker.models.decoder import DecoderAttention
from tokenmill_service.worker.models.moe import MOE_FACTS, MOE_LAYER_NAMES, MoEForCausalLM, moe_tensors, set_moe
from tokenmill_service.worker.models.params import LayerParams
from tokenmill_service.worker.models.registry import register_family
from tokenmill_service.worker.models.spec import ConfigReader, FamilySpec, GGUFField, Names


class WholeNormedAttention(DecoderAttention):
    """q and k RMS-normed over each token's whole projection (all heads at once) before rotary: OLMoE's, OLMo 2's."""

    def __init__(self, p: LayerParams) -> None:
        if p.tp.size > 1:
            raise ValueError(
                f"{p.config.architecture}'s q/k norms span every attention head: it does not run tensor-parallel"
            )
        super().__init__(p)
        act_dtype, eps = self.qkv_proj.quant.act_dtype, p.config.rms_norm_eps
        self.q_norm = RMSNorm(self.qkv_proj.q_size, eps, p.ops, act_dtype)
        self.k_norm = RMSNorm(self.qkv_proj.kv_size, eps, p.ops, act_dtype)

    def before_rotary(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _norm_all_heads(self.q_norm, q), _norm_all_heads(self.k_norm, k)


def _norm_all_heads(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """RMSNorm over all heads of each token of x [T, heads, head_dim] at once."""
    tokens, heads, head_dim = x.shape
    normed: torch.Tensor = norm(x.reshape(tokens, heads * head_dim))[0]  # a copy: x is a strided view
    return normed.view(tokens, heads, head_dim)


class OlmoeForCausalLM(MoEForCausalLM):
    attention_type = WholeNormedAttention


def _read_hf(raw: dict[str, Any], hf_architecture: str, config: ModelConfig) -> None:
    if raw.get("clip_qkv") is not None:
        raise ValueError("clip_qkv is not supported")
    experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
    per_token, renormalize = int(raw["num_experts_per_tok"]), bool(raw.get("norm_topk_prob"))
    set_moe(config, experts, per_token, config.intermediate_size, renormalize, range(config.num_layers))


def _read_gguf(field: GGUFField, arch: str, config: ModelConfig) -> None:
    norm = field(f"{arch}.expert_weights_norm")  # llama.cpp's OLMoE graph does not renormalize
    set_moe(
        config,
        int(field(f"{arch}.expert_count")),
        int(field(f"{arch}.expert_used_count") or 0),
        config.intermediate_size,
        bool(norm),
        range(config.num_layers),
    )


# llama.cpp's names of the q/k norms over the whole projection ([heads * head_dim], [kv heads * head_dim]).
WHOLE_QK_NORM_NAMES = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}

OLMOE = register_family(
    FamilySpec(
        ("olmoe",),
        OlmoeForCausalLM,
        Names({"OlmoeForCausalLM": "olmoe"}, {"olmoe": "olmoe"}),
        ConfigReader(_read_hf, _read_gguf),
        moe_tensors({**MOE_LAYER_NAMES, **WHOLE_QK_NORM_NAMES}),
        dataclasses.replace(MOE_FACTS, qk_norm="whole"),
    )
)
