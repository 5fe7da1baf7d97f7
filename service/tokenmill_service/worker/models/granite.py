"""Granite 3 (dense): a Llama-family decoder with four scalars of its own (transformers' modeling_granite.py).

- ``embedding_multiplier`` scales the token embeddings (``DecoderModel.embed``);
- ``attention_multiplier`` is the attention scale, in place of 1/sqrt(head_dim);
- ``residual_multiplier`` scales each sub-layer's output, attention's and the MLP's, before its
  residual add (``DecoderLayer.branch``: ``residual_multiplier``);
- ``logits_scaling`` divides the logits.

Everything else is the decoder's (decoder.py). They are read from config.json, or from a GGUF's ``granite.*`` keys
(llama.cpp's converter writes ``embedding_scale``, ``attention.scale``, ``residual_scale`` and
``logit_scale``, and permutes q/k as for Llama), into ``ModelConfig.extra``. The native decoder stack
runs Granite's layers: it scales each sub-layer's output by the residual multiplier as the eager layer
does (one float32 product a value, before the residual add) and takes the attention scale as every
family's; the embeddings and the logits stay the model's (``embed``, ``compute_logits``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from tokenmill_service.worker.models.config import ModelConfig
from tokenmill_service.worker.models.decoder import (
    DecoderAttention,
    DecoderForCausalLM,
    DecoderLayer,
    DecoderModel,
    Regions,
)
from tokenmill_service.worker.models.params import LayerParams
from tokenmill_service.worker.models.registry import register_family
from tokenmill_service.worker.models.spec import ConfigReader, Facts, FamilySpec, GGUFField, Names

# ModelConfig.extra key -> (config.json key, GGUF key after "granite.")
MULTIPLIERS = {
    "embedding_multiplier": ("embedding_multiplier", "embedding_scale"),
    "attention_multiplier": ("attention_multiplier", "attention.scale"),
    "residual_multiplier": ("residual_multiplier", "residual_scale"),
    "logits_scaling": ("logits_scaling", "logit_scale"),
}


def _multiplier(config: ModelConfig, key: str) -> float:
    return float(config.extra[key])  # type: ignore[arg-type]


class GraniteAttention(DecoderAttention):
    def __init__(self, p: LayerParams) -> None:
        super().__init__(p)
        self.params = dataclasses.replace(self.params, scale=_multiplier(p.config, "attention_multiplier"))


class GraniteDecoderLayer(DecoderLayer):
    def __init__(self, p: LayerParams, attention_type: type[DecoderAttention] = GraniteAttention) -> None:
        super().__init__(p, attention_type)
        self.residual_multiplier = _multiplier(p.config, "residual_multiplier")  # DecoderLayer.branch's


class GraniteModel(DecoderModel):
    def __init__(self, config: ModelConfig, *args: Any) -> None:
        super().__init__(config, *args)
        self.embedding_multiplier = _multiplier(config, "embedding_multiplier")

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows: torch.Tensor = self.embed_tokens(input_ids)
        return rows * self.embedding_multiplier


class GraniteForCausalLM(DecoderForCausalLM):
    attention_type = GraniteAttention
    model_type = GraniteModel
    layer_type = GraniteDecoderLayer

    def __init__(self, config: ModelConfig, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        self.logits_scaling = _multiplier(config, "logits_scaling")

    def compute_logits(self, hidden: torch.Tensor, run: Regions | None = None) -> torch.Tensor:
        return super().compute_logits(hidden, run) / self.logits_scaling


def _read_hf(raw: dict[str, Any], hf_architecture: str, config: ModelConfig) -> None:
    for key, (hf_key, _) in MULTIPLIERS.items():
        config.extra[key] = float(raw.get(hf_key, 1.0))  # transformers' defaults: all 1


def _read_gguf(field: GGUFField, gguf_architecture: str, config: ModelConfig) -> None:
    for key, (_, gguf_key) in MULTIPLIERS.items():
        value = field(f"{gguf_architecture}.{gguf_key}")
        # llama.cpp leaves out a scale that is not there (0 is "absent" to it as well).
        config.extra[key] = float(value) if value else 1.0
    if not field(f"{gguf_architecture}.attention.scale"):
        config.extra["attention_multiplier"] = config.head_dim**-0.5  # llama.cpp's default


GRANITE = register_family(
    FamilySpec(
        ("granite",),
        GraniteForCausalLM,
        Names({"GraniteForCausalLM": "granite"}, {"granite": "granite"}, frozenset({"granite"})),
        ConfigReader(_read_hf, _read_gguf),
        facts=Facts(residual_multiplier=True, scaled_embeddings=True),
    )
)
