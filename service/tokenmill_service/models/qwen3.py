"""Qwen3 (dense): a Llama-family decoder whose attention RMS-normalizes each head of q and of k.

Everything else is llama.py's: the norm sits in ``LlamaAttention.before_rotary`` (after the q/k/v
projection, before rotary) and goes through the ops backend's ``rms_norm``, so the native, torch
and triton backends all serve it. Qwen3 has no q/k/v bias and its ``head_dim`` need not be
hidden / heads (``ModelConfig.head_dim`` is read from the checkpoint).

``q_norm`` / ``k_norm`` weights are [head_dim], shared by every head: under tensor parallelism each
rank keeps them whole, whichever heads it holds. The native decoder stack (one C++ call for every
layer) runs the same norm on the same rows (``qk_norm = "heads"``).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from tokenmill_service.distributed.parallel import TensorParallel
from tokenmill_service.kernels.interface import Ops
from tokenmill_service.layers.linear import QuantFactory
from tokenmill_service.layers.norm import RMSNorm
from tokenmill_service.layers.rotary import RotaryEmbedding
from tokenmill_service.models.config import ModelConfig
from tokenmill_service.models.llama import GGUF_LAYER_NAMES, LlamaAttention, LlamaForCausalLM
from tokenmill_service.models.registry import register_model


class Qwen3Attention(LlamaAttention):
    qk_norm: ClassVar[str] = "heads"

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
        super().__init__(config, prefix, layer_idx, rotary, ops, quant, tp)
        # Normed q and k stay in the projection's dtype, as rotary and attention take them.
        act_dtype = self.qkv_proj.quant.act_dtype
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, ops, act_dtype)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, ops, act_dtype)

    def before_rotary(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _norm_heads(self.q_norm, q), _norm_heads(self.k_norm, k)


def _norm_heads(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """RMSNorm over each head of x [T, heads, head_dim]: one row per (token, head) for the ops' rms_norm."""
    tokens, heads, head_dim = x.shape
    # q and k are strided views into the packed qkv output: reshape copies them into whole rows.
    normed: torch.Tensor = norm(x.reshape(tokens * heads, head_dim))[0]
    return normed.view(tokens, heads, head_dim)


@register_model("qwen3")
class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_type: ClassVar[type[LlamaAttention]] = Qwen3Attention
    # Qwen3Model: the decoder without its head, as sentence-transformers saves an embedding model.
    hf_architectures: ClassVar[dict[str, str]] = {"Qwen3ForCausalLM": "qwen3", "Qwen3Model": "qwen3"}
    gguf_architectures: ClassVar[dict[str, str]] = {"qwen3": "qwen3"}
    gguf_layer_names: ClassVar[dict[str, str]] = {
        **GGUF_LAYER_NAMES,
        "attn_q_norm": "self_attn.q_norm",  # [head_dim] each
        "attn_k_norm": "self_attn.k_norm",
    }
