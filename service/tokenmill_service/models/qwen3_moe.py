"""Qwen3-MoE (transformers' modeling_qwen3_moe.py): Qwen3's attention (q/k normed per head, qwen3.py)
and a mixture of experts in the layers ``decoder_sparse_step`` and ``mlp_only_layers`` say, a dense
MLP (``intermediate_size``) in the others. The top ``num_experts_per_tok`` of ``num_experts`` by
softmax, renormalized when ``norm_topk_prob``; each expert ``moe_intermediate_size`` wide.

llama.cpp's "qwen3moe" GGUFs hold experts in every layer (``expert_feed_forward_length`` wide) and
always renormalize (``expert_weights_norm``, where written, says otherwise).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from tokenmill_service.models.config import ModelConfig
from tokenmill_service.models.llama import LlamaAttention, read_sliding_window
from tokenmill_service.models.moe import MoEForCausalLM, set_moe
from tokenmill_service.models.qwen3 import Qwen3Attention, Qwen3ForCausalLM
from tokenmill_service.models.registry import register_model


@register_model("qwen3_moe")
class Qwen3MoeForCausalLM(MoEForCausalLM):
    attention_type: ClassVar[type[LlamaAttention]] = Qwen3Attention
    hf_architectures: ClassVar[dict[str, str]] = {"Qwen3MoeForCausalLM": "qwen3_moe"}
    gguf_architectures: ClassVar[dict[str, str]] = {"qwen3moe": "qwen3_moe"}
    gguf_layer_names: ClassVar[dict[str, str]] = {
        **MoEForCausalLM.gguf_layer_names,
        **Qwen3ForCausalLM.gguf_layer_names,
    }

    @classmethod
    def read_hf_config(cls, raw: dict[str, Any], hf_architecture: str, config: ModelConfig) -> None:
        experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
        step, dense = int(raw.get("decoder_sparse_step", 1)), set(raw.get("mlp_only_layers") or [])
        layers = [i for i in range(config.num_layers) if i not in dense and experts > 0 and (i + 1) % step == 0]
        width = int(raw["moe_intermediate_size"])
        set_moe(config, experts, int(raw["num_experts_per_tok"]), width, bool(raw.get("norm_topk_prob")), layers)
        read_sliding_window(raw, hf_architecture, config)

    @classmethod
    def read_gguf_config(cls, field: Callable[[str], Any], gguf_architecture: str, config: ModelConfig) -> None:
        arch = gguf_architecture
        norm = field(f"{arch}.expert_weights_norm")
        set_moe(
            config,
            int(field(f"{arch}.expert_count")),
            int(field(f"{arch}.expert_used_count") or 0),
            int(field(f"{arch}.expert_feed_forward_length")),
            True if norm is None else bool(norm),
            range(config.num_layers),
        )
