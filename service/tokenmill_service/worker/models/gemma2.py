"""Gemma 2: the decoder (decoder.py) with Gemma's norms, GeGLU, soft-capping and sliding-window layers
(transformers' modeling_gemma2.py is the reference).

- Token embeddings are scaled by sqrt(hidden), the factor rounded to the activations' dtype first,
  as transformers does (``GemmaModel.embed``).
- RMSNorm multiplies by (1 + w), in float32 (``GemmaRMSNorm``, which keeps 1 + w). llama.cpp's
  converter writes the norms with the 1 already added, so a GGUF's are taken as they are.
- Each layer norms its input, attention's output, the MLP's input and the MLP's output; the residual
  adds come after the post-norms (``gemma_post_attention``, the family's ``Regions``).
- The MLP is GeGLU: gelu(gate, tanh approximation) * up (``Ops.gelu_tanh_and_mul``).
- Attention scales by query_pre_attn_scalar ** -0.5, soft-caps its scores (tanh(s / cap) * cap), and
  every even layer (0, 2, ...) attends within a sliding window (``layer_types`` where the config says);
  the ops backend's attention takes both (worker/kernels/interface.py). The logits are soft-capped too.

GGUF (llama.cpp's ``gemma2``): ``attn_logit_softcapping``, ``final_logit_softcapping``,
``attention.sliding_window`` (and ``sliding_window_pattern``) with llama.cpp's defaults where absent;
the tensors ``post_attention_norm``, ``ffn_norm`` (before the MLP) and ``post_ffw_norm``. llama.cpp
keeps no query_pre_attn_scalar: it scales by head_dim ** -0.5, or (hidden / heads) ** -0.5 for the
27B (46 layers), and so does this reader.

The native decoder stack runs Gemma's layers too (worker/engine/native_stack.py): its GeGLU is elementwise.cpp's
(the native ops' ``gelu_tanh_and_mul``, so the eager loop's bits), the layer's sandwich norms
(its spec's ``norms="sandwich"``) and its attention's scale, window and soft cap go with it; the embeddings' scale
and the final logit soft cap stay here (``GemmaModel.embed``, ``compute_logits``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, ClassVar, cast

import torch
from torch import nn

from tokenmill_service.worker.kernels.interface import Ops
from tokenmill_service.worker.layers.norm import RMSNorm
from tokenmill_service.worker.layers.quant.gguf_blocks import CheckpointTensor, dense
from tokenmill_service.worker.models.config import FULL, SLIDING, ModelConfig
from tokenmill_service.worker.models.decoder import (
    DecoderAttention,
    DecoderForCausalLM,
    DecoderLayer,
    DecoderModel,
    GatedMLP,
    Regions,
)
from tokenmill_service.worker.models.params import LayerParams
from tokenmill_service.worker.models.registry import register_family
from tokenmill_service.worker.models.spec import (
    GGUF_LAYER_NAMES,
    ConfigReader,
    Facts,
    FamilySpec,
    GGUFField,
    Names,
    Tensors,
)

GEMMA_GGUF_LAYER_NAMES = {
    **GGUF_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


class GemmaRMSNorm(RMSNorm):
    """RMSNorm times (1 + w): keeps 1 + w as its weight, adding ``offset`` (1, or 0 for a GGUF, whose
    converter added it) to the checkpoint's tensor in float32, as transformers computes it."""

    def __init__(self, dim: int, eps: float, ops: Ops, out_dtype: torch.dtype, offset: float) -> None:
        super().__init__(dim, eps, ops, out_dtype)
        self.offset = offset

    def load_weight(self, tensor: CheckpointTensor, shard_id: None = None) -> None:
        self.weight.data.copy_(dense(tensor).float() + self.offset)


def gemma_norm(config: ModelConfig, dim: int, ops: Ops, out_dtype: torch.dtype) -> GemmaRMSNorm:
    return GemmaRMSNorm(dim, config.rms_norm_eps, ops, out_dtype, cast(float, config.extra["norm_offset"]))


def _optional(value: object) -> float | None:
    return float(cast(float, value)) if value else None


class Gemma2Attention(DecoderAttention):
    def __init__(self, p: LayerParams) -> None:
        super().__init__(p)
        config = p.config
        self.params = replace(
            self.params,
            scale=float(cast(float, config.extra["query_pre_attn_scalar"])) ** -0.5,
            softcap=_optional(config.extra.get("attn_logit_softcapping")),
        )


class GemmaMLP(GatedMLP):
    """GeGLU: gate/up, GELU (tanh) and mul, down."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cast(torch.Tensor, self.down_proj(self.ops.gelu_tanh_and_mul(self.gate_up_proj(x))))


class GemmaDecoderLayer(DecoderLayer):
    """Sandwich norms: attention's and the MLP's outputs each normed before their residual add, the MLP's
    input by ``pre_feedforward_layernorm`` (``gemma_post_attention``)."""

    def __init__(self, p: LayerParams, attention_type: type[DecoderAttention] = Gemma2Attention) -> None:
        super().__init__(p, attention_type)
        config, ops, act_dtype, hidden = p.config, p.ops, p.act_dtype, p.config.hidden_size
        self.input_layernorm = gemma_norm(config, hidden, ops, act_dtype)
        self.post_attention_layernorm = gemma_norm(config, hidden, ops, act_dtype)
        self.pre_feedforward_layernorm = gemma_norm(config, hidden, ops, act_dtype)
        self.post_feedforward_layernorm = gemma_norm(config, hidden, ops, act_dtype)

    def make_mlp(self, p: LayerParams) -> nn.Module:
        return GemmaMLP(p.config, p.prefix, p.ops, p.quant, p.tp)


def gemma_post_attention(
    layer: GemmaDecoderLayer, attn: torch.Tensor, residual: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Output projection and its norm, residual add, pre-MLP norm, MLP and its norm: (x, residual);
    the next layer's input norm (or the final norm) adds x to the residual."""
    h, _ = layer.post_attention_layernorm(layer.self_attn.o_proj(attn))
    h, residual = layer.pre_feedforward_layernorm(h, residual)
    x, _ = layer.post_feedforward_layernorm(layer.mlp(h))
    return x, residual


@dataclass(slots=True)
class GemmaRegions(Regions):
    post_attention: Callable[..., tuple[torch.Tensor, torch.Tensor]] = gemma_post_attention


class GemmaModel(DecoderModel):
    def __init__(self, config: ModelConfig, *args: Any) -> None:
        super().__init__(config, *args)
        # sqrt(hidden) as a number of the activations' dtype (transformers: a tensor cast to it).
        self.normalizer = float(torch.tensor(math.sqrt(config.hidden_size), dtype=self.act_dtype))

    def make_norm(self, config: ModelConfig, ops: Ops, out_dtype: torch.dtype) -> RMSNorm:
        return gemma_norm(config, config.hidden_size, ops, out_dtype)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return cast(torch.Tensor, self.embed_tokens(input_ids)).to(self.act_dtype) * self.normalizer


def read_gemma_hf_config(raw: dict[str, Any], config: ModelConfig, defaults: dict[str, Any], pattern: int) -> None:
    """What Gemma 2 and 3 read from config.json: transformers' defaults (``defaults``) where a key is
    absent, and ``layer_types``, or every ``pattern``-th layer global where there are none."""
    if raw.get("use_bidirectional_attention"):
        raise ValueError("bidirectional attention (use_bidirectional_attention) is not served")
    extra = config.extra
    for key, default in defaults.items():
        extra[key] = raw.get(key, default)
    extra["norm_offset"] = 1.0
    types = raw.get("layer_types") or [SLIDING if (i + 1) % pattern else FULL for i in range(config.num_layers)]
    if len(types) != config.num_layers or set(types) - {SLIDING, FULL}:
        raise ValueError(f"layer_types {types} are not {config.num_layers} of {SLIDING!r} / {FULL!r}")
    extra["layer_types"] = list(types)


def read_gemma_gguf_config(
    field: GGUFField, arch: str, config: ModelConfig, window: int | None, pattern: int, big: int
) -> None:
    """What Gemma 2 and 3 GGUFs say, as llama.cpp reads them: the window (``window`` where absent;
    None: no sliding layers), the local layers (``sliding_window_pattern``: every ``pattern``-th
    layer global, or one flag per layer), and the attention scale (head_dim, or hidden / heads for
    a ``big`` layer count: the 27B)."""
    extra = config.extra
    extra["norm_offset"] = 0.0  # llama.cpp's converter added the 1
    found = field(f"{arch}.attention.sliding_window")
    window = int(found) if found else window
    extra["sliding_window"] = window
    flags = field(f"{arch}.attention.sliding_window_pattern")
    if isinstance(flags, list):
        local = [bool(f) for f in flags][: config.num_layers]
    else:
        n = int(flags) if flags else pattern
        local = [n == 0 or i % n < n - 1 for i in range(config.num_layers)]
    extra["layer_types"] = [SLIDING if window and is_local else FULL for is_local in local]
    per_head = config.hidden_size // config.num_heads if config.num_layers == big else config.head_dim
    extra["query_pre_attn_scalar"] = float(per_head)


class Gemma2ForCausalLM(DecoderForCausalLM):
    attention_type: ClassVar[type[DecoderAttention]] = Gemma2Attention
    model_type: ClassVar[type[DecoderModel]] = GemmaModel
    layer_type: ClassVar[type[DecoderLayer]] = GemmaDecoderLayer
    regions_type: ClassVar[type[Regions]] = GemmaRegions

    def __init__(self, config: ModelConfig, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        self.final_softcap = _optional(config.extra.get("final_logit_softcapping"))

    def compute_logits(self, hidden: torch.Tensor, run: Regions | None = None) -> torch.Tensor:
        logits = super().compute_logits(hidden, run)
        if self.final_softcap is None:
            return logits
        return torch.tanh(logits / self.final_softcap) * self.final_softcap


def _read_hf(raw: dict[str, Any], hf_architecture: str, config: ModelConfig) -> None:
    defaults = {
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
    }
    read_gemma_hf_config(raw, config, defaults, pattern=2)


def _read_gguf(field: GGUFField, gguf_architecture: str, config: ModelConfig) -> None:
    read_gemma_gguf_config(field, gguf_architecture, config, window=4096, pattern=2, big=46)
    for key, default in (("attn_logit_softcapping", 50.0), ("final_logit_softcapping", 30.0)):
        value = field(f"{gguf_architecture}.{key}")
        config.extra[key] = default if value is None else float(value)


# What the Gemma families' specs state of their layers: sandwich norms, GeGLU, soft caps, scaled embeddings,
# every other layer (Gemma 2's) windowed.
GEMMA_FACTS = Facts(
    norms="sandwich",
    activation="gelu_tanh",
    sliding_windows=True,
    attention_softcap=True,
    logit_softcap=True,
    scaled_embeddings=True,
)
GEMMA_HF_ACTIVATION = ("hidden_activation", "gelu_pytorch_tanh")

GEMMA2 = register_family(
    FamilySpec(
        ("gemma2",),
        Gemma2ForCausalLM,
        Names({"Gemma2ForCausalLM": "gemma2"}, {"gemma2": "gemma2"}),
        ConfigReader(_read_hf, _read_gguf, hf_activation=GEMMA_HF_ACTIVATION),
        Tensors(gguf_layer=GEMMA_GGUF_LAYER_NAMES),
        GEMMA_FACTS,
    )
)
