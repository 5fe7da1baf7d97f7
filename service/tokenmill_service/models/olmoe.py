"""OLMoE (transformers' modeling_olmoe.py): Llama attention whose q and k are RMS-normalized over the
whole projection (all heads together, unlike Qwen3's per-head norm), and every layer's MLP a mixture
of ``num_experts`` experts, the top ``num_experts_per_tok`` by softmax, renormalized only when
``norm_topk_prob`` (OLMoE-1B-7B does not). Each expert is ``intermediate_size`` wide.

The norms span every head, so a rank holding some heads cannot apply them alone: tensor parallelism
is refused for this family (a ValueError at load, naming why). ``clip_qkv`` is refused too.
llama.cpp's "olmoe" GGUFs name the norms ``attn_q_norm`` / ``attn_k_norm`` and stack the experts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch

from tokenmill_service.distributed.parallel import TensorParallel
from tokenmill_service.kernels.interface import Ops
from tokenmill_service.layers.linear import QuantFactory
from tokenmill_service.layers.norm import RMSNorm
from tokenmill_service.layers.rotary import RotaryEmbedding
from tokenmill_service.models.config import ModelConfig
from tokenmill_service.models.llama import LlamaAttention
from tokenmill_service.models.moe import MoEForCausalLM, set_moe
from tokenmill_service.models.registry import register_model


class OlmoeAttention(LlamaAttention):
    qk_norm: ClassVar[str] = "whole"

    def __init__(
        self,
        config: ModelConfig,
        prefix: str,
        layer_idx: int,
        rotary: RotaryEmbedding,
        ops: Ops,
        quant: QuantFactory,
        tp: TensorParallel,
    ) -> None:
        if tp.size > 1:
            raise ValueError("OLMoE's q/k norms span every attention head: it does not run tensor-parallel")
        super().__init__(config, prefix, layer_idx, rotary, ops, quant, tp)
        act_dtype = self.qkv_proj.quant.act_dtype
        self.q_norm = RMSNorm(self.qkv_proj.q_size, config.rms_norm_eps, ops, act_dtype)
        self.k_norm = RMSNorm(self.qkv_proj.kv_size, config.rms_norm_eps, ops, act_dtype)

    def before_rotary(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _norm_all_heads(self.q_norm, q), _norm_all_heads(self.k_norm, k)


def _norm_all_heads(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """RMSNorm over all heads of each token of x [T, heads, head_dim] at once."""
    tokens, heads, head_dim = x.shape
    normed: torch.Tensor = norm(x.reshape(tokens, heads * head_dim))[0]  # a copy: x is a strided view
    return normed.view(tokens, heads, head_dim)


@register_model("olmoe")
class OlmoeForCausalLM(MoEForCausalLM):
    attention_type: ClassVar[type[LlamaAttention]] = OlmoeAttention
    hf_architectures: ClassVar[dict[str, str]] = {"OlmoeForCausalLM": "olmoe"}
    gguf_architectures: ClassVar[dict[str, str]] = {"olmoe": "olmoe"}
    gguf_layer_names: ClassVar[dict[str, str]] = {
        **MoEForCausalLM.gguf_layer_names,
        "attn_q_norm": "self_attn.q_norm",  # [heads * head_dim]
        "attn_k_norm": "self_attn.k_norm",  # [kv heads * head_dim]
    }

    @classmethod
    def read_hf_config(cls, raw: dict[str, Any], hf_architecture: str, config: ModelConfig) -> None:
        if raw.get("clip_qkv") is not None:
            raise ValueError("clip_qkv is not supported")
        experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
        per_token, renormalize = int(raw["num_experts_per_tok"]), bool(raw.get("norm_topk_prob"))
        set_moe(config, experts, per_token, config.intermediate_size, renormalize, range(config.num_layers))

    @classmethod
    def read_gguf_config(cls, field: Callable[[str], Any], gguf_architecture: str, config: ModelConfig) -> None:
        arch = gguf_architecture
        norm = field(f"{arch}.expert_weights_norm")  # llama.cpp's OLMoE graph does not renormalize
        set_moe(
            config,
            int(field(f"{arch}.expert_count")),
            int(field(f"{arch}.expert_used_count") or 0),
            config.intermediate_size,
            bool(norm),
            range(config.num_layers),
        )
