"""Qwen3-MoE (transformers' modeling_qwen3_moe.py): Qwen3's attention (q/k normed per head, qwen3.py)
and a mixture of experts in the layers ``decoder_sparse_step`` and ``mlp_only_layers`` say, a dense
MLP (``intermediate_size``) in the others. The top ``num_experts_per_tok`` of ``num_experts`` by
softmax, renormalized when ``norm_topk_prob``; each expert ``moe_intermediate_size`` wide.

llama.cpp's "qwen3moe" GGUFs hold experts in every layer (``expert_feed_forward_length`` wide) and
always renormalize (``expert_weights_norm``, where written, says otherwise).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tokenmill_service.worker.models.config import ModelConfig
from tokenmill_service.worker.models.moe import MOE_FACTS, MOE_LAYER_NAMES, MoEForCausalLM, moe_tensors, set_moe
from tokenmill_service.worker.models.qwen3 import QK_NORM_NAMES, Qwen3Attention
from tokenmill_service.worker.models.registry import register_family
from tokenmill_service.worker.models.spec import ConfigReader, FamilySpec, GGUFField, Names, SlidingWindows


class Qwen3MoeForCausalLM(MoEForCausalLM):
    attention_type = Qwen3Attention


def _read_hf(raw: dict[str, Any], hf_architecture: str, config: ModelConfig) -> None:
    experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
    step, dense = int(raw.get("decoder_sparse_step", 1)), set(raw.get("mlp_only_layers") or [])
    layers = [i for i in range(config.num_layers) if i not in dense and experts > 0 and (i + 1) % step == 0]
    width = int(raw["moe_intermediate_size"])
    set_moe(config, experts, int(raw["num_experts_per_tok"]), width, bool(raw.get("norm_topk_prob")), layers)


def _read_gguf(field: GGUFField, arch: str, config: ModelConfig) -> None:
    norm = field(f"{arch}.expert_weights_norm")
    set_moe(
        config,
        int(field(f"{arch}.expert_count")),
        int(field(f"{arch}.expert_used_count") or 0),
        int(field(f"{arch}.expert_feed_forward_length")),
        True if norm is None else bool(norm),
        range(config.num_layers),
    )


QWEN3_MOE = register_family(
    FamilySpec(
        ("qwen3_moe",),
        Qwen3MoeForCausalLM,
        Names({"Qwen3MoeForCausalLM": "qwen3_moe"}, {"qwen3moe": "qwen3_moe"}),
        # transformers' Qwen3-MoE: a window only with use_sliding_window, then on every layer.
        ConfigReader(_read_hf, _read_gguf, windows=SlidingWindows(flagged=True, default=4096)),
        moe_tensors({**MOE_LAYER_NAMES, **QK_NORM_NAMES}),
        dataclasses.replace(MOE_FACTS, qk_norm="heads", sliding_windows=True),
    )
)
