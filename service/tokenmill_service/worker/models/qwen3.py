"""Qwen3 (dense): a Llama-family decoder whose attention RMS-normalizes each head of q and of k.

Everything else is the decoder's (decoder.py): the norm sits in ``DecoderAttention.before_rotary`` (after the q/k/v
projection, before rotary) and goes through the ops backend's ``rms_norm``, so the native, torch
and triton backends all serve it. Qwen3 has no q/k/v bias and its ``head_dim`` need not be
hidden / heads (``ModelConfig.head_dim`` is read from the checkpoint).

``q_norm`` / ``k_norm`` weights are [head_dim], shared by every head: under tensor parallelism each
rank keeps them whole, whichever heads it holds. The native decoder stack (one C++ call for every
layer) runs the same norm on the same rows (its spec's ``qk_norm="heads"``).
"""

from __future__ import annotations

import torch

from tokenmill_service.worker.layers.norm import RMSNorm
from tokenmill_service.worker.models.decoder import DecoderAttention, DecoderForCausalLM
from tokenmill_service.worker.models.params import LayerParams
from tokenmill_service.worker.models.registry import register_family
from tokenmill_service.worker.models.spec import (
    GGUF_LAYER_NAMES,
    ConfigReader,
    Facts,
    FamilySpec,
    Names,
    SlidingWindows,
    Tensors,
)


class HeadNormedAttention(DecoderAttention):
    """q and k RMS-normed per head between the projection and rotary (``q_norm``, ``k_norm``: [head_dim] each,
    made by the family's subclass): Qwen3's, Gemma 3's."""

    q_norm: RMSNorm
    k_norm: RMSNorm

    def before_rotary(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _norm_heads(self.q_norm, q), _norm_heads(self.k_norm, k)


class Qwen3Attention(HeadNormedAttention):
    def __init__(self, p: LayerParams) -> None:
        super().__init__(p)
        # Normed q and k stay in the projection's dtype, as rotary and attention take them.
        act_dtype, config = self.qkv_proj.quant.act_dtype, p.config
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, p.ops, act_dtype)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, p.ops, act_dtype)


def _norm_heads(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """RMSNorm over each head of x [T, heads, head_dim]: one row per (token, head) for the ops' rms_norm."""
    tokens, heads, head_dim = x.shape
    # q and k are strided views into the packed qkv output: reshape copies them into whole rows.
    normed: torch.Tensor = norm(x.reshape(tokens * heads, head_dim))[0]
    return normed.view(tokens, heads, head_dim)


class Qwen3ForCausalLM(DecoderForCausalLM):
    attention_type = Qwen3Attention


# llama.cpp's names of the q/k norms ([head_dim] each), beside Llama's.
QK_NORM_NAMES = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}

QWEN3 = register_family(
    FamilySpec(
        ("qwen3",),
        Qwen3ForCausalLM,
        # Qwen3Model: the decoder without its head, as sentence-transformers saves an embedding model.
        Names({"Qwen3ForCausalLM": "qwen3", "Qwen3Model": "qwen3"}, {"qwen3": "qwen3"}),
        ConfigReader(windows=SlidingWindows(every_layer=False, flagged=True, default=4096)),
        Tensors(gguf_layer={**GGUF_LAYER_NAMES, **QK_NORM_NAMES}),
        Facts(qk_norm="heads", sliding_windows=True),
    )
)
