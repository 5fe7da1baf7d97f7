"""OLMo 2 (transformers' modeling_olmo2.py): the decoder with its norms after each sub-layer, not before.

- Each layer adds ``post_attention_layernorm(attention(x))`` to the residual stream, then
  ``post_feedforward_layernorm(mlp(x))``: the sub-layers read the stream itself (no input norm, no
  pre-MLP norm), and the final norm is the decoder's (``olmo2_pre_attention``, ``olmo2_post_attention``).
- q and k are RMS-normed over each token's whole projection before rotary, as OLMoE's (``q_norm`` [heads *
  head_dim], ``k_norm`` [kv heads * head_dim]): so, as OLMoE, it does not run tensor-parallel.

Everything else is the decoder's: SiLU gated MLP, rotary over whole heads, no biases. The native decoder
stack norms each layer's input, which OLMo 2 does not: its layers run one by one (or compiled).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from tokenmill_service.worker.layers.norm import RMSNorm
from tokenmill_service.worker.models.decoder import DecoderAttention, DecoderForCausalLM, DecoderLayer, Regions
from tokenmill_service.worker.models.olmoe import WholeNormedAttention
from tokenmill_service.worker.models.params import LayerParams
from tokenmill_service.worker.models.registry import register_family
from tokenmill_service.worker.models.spec import Facts, FamilySpec, Names


class Olmo2DecoderLayer(DecoderLayer):
    """The decoder's layer with a norm after attention and after the MLP, and none before either."""

    def __init__(self, p: LayerParams, attention_type: type[DecoderAttention] = WholeNormedAttention) -> None:
        super().__init__(p, attention_type)
        del self.input_layernorm  # the sub-layers read the residual stream as it is
        self.post_feedforward_layernorm = RMSNorm(p.config.hidden_size, p.config.rms_norm_eps, p.ops, p.act_dtype)
        self.act_dtype = p.act_dtype


def olmo2_pre_attention(
    layer: Olmo2DecoderLayer, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Residual add (float32), q/k/v projection with its q/k norms, rotary: (q, k, v, the stream)."""
    stream = x.float() if residual is None else residual + x
    q, k, v = layer.self_attn.project(positions, stream.to(layer.act_dtype))
    return q, k, v, stream


def olmo2_post_attention(
    layer: Olmo2DecoderLayer, attn: torch.Tensor, residual: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Output projection and its norm added to the stream, the MLP on the stream and its norm: (x, the stream);
    the next layer (or the final norm) adds x to the stream."""
    h, _ = layer.post_attention_layernorm(layer.self_attn.o_proj(attn))
    stream = residual + h
    x, _ = layer.post_feedforward_layernorm(layer.mlp(stream.to(layer.act_dtype)))
    return x, stream


@dataclass(slots=True)
class Olmo2Regions(Regions):
    pre_attention: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = olmo2_pre_attention
    post_attention: Callable[..., tuple[torch.Tensor, torch.Tensor]] = olmo2_post_attention


class Olmo2ForCausalLM(DecoderForCausalLM):
    attention_type: ClassVar[type[DecoderAttention]] = WholeNormedAttention
    layer_type: ClassVar[type[DecoderLayer]] = Olmo2DecoderLayer
    regions_type: ClassVar[type[Regions]] = Olmo2Regions


OLMO2 = register_family(
    FamilySpec(
        ("olmo2",),
        Olmo2ForCausalLM,
        Names({"Olmo2ForCausalLM": "olmo2"}),
        facts=Facts(
            norms="post",
            qk_norm="whole",
            native_stack_gap="the stack norms each layer's input, and OLMo 2 norms only its sub-layers' outputs",
        ),
    )
)

__all__ = ["OLMO2", "Olmo2ForCausalLM"]
