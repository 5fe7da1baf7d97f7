"""Gemma 3 (text; ``Gemma3ForCausalLM``, config ``gemma3_text``): Gemma 2's decoder (gemma2.py) with
q/k norms and two rotary tables, and no attention soft-capping (transformers' modeling_gemma3.py).

- Each head of q and of k is RMS-normed, (1 + w) as Gemma's other norms, before rotary (as Qwen3's).
- Five local (sliding-window) layers to one global: ``layer_types``, or ``sliding_window_pattern``
  (6: every sixth layer global) where a config has none.
- Local layers rotate with ``rope_local_base_freq`` (transformers 5: ``rope_parameters``'
  ``sliding_attention``), global ones with ``rope_theta`` and, where configured, linear RoPE scaling
  (``rope_scaling`` / ``rope_parameters``' ``full_attention``: the frequencies divided by the factor).
- Logits are soft-capped only where ``final_logit_softcapping`` is set (it is not in Google's configs).

GGUF (llama.cpp's ``gemma3``): ``rope.freq_base`` (global), ``rope.freq_base_swa`` (local; 10000 where
absent), ``rope.scaling.type`` ``linear`` and ``rope.scaling.factor`` (global layers only, as llama.cpp
applies them), ``attention.sliding_window`` (none: every layer global) with the pattern of 6, and
``attn_q_norm`` / ``attn_k_norm``.

The native decoder stack runs it as Gemma 2's, with its per-head q/k norms (its spec's ``qk_norm="heads"``) and each layer's
rotary tables (the local layers' their own).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, cast

import torch

from tokenmill_service.worker.kernels.interface import Ops
from tokenmill_service.worker.layers.rotary import RotaryEmbedding
from tokenmill_service.worker.models.config import SLIDING, ModelConfig
from tokenmill_service.worker.models.decoder import DecoderAttention, DecoderModel
from tokenmill_service.worker.models.gemma2 import (
    GEMMA_FACTS,
    GEMMA_GGUF_LAYER_NAMES,
    GEMMA_HF_ACTIVATION,
    Gemma2Attention,
    Gemma2ForCausalLM,
    GemmaModel,
    gemma_norm,
    read_gemma_gguf_config,
    read_gemma_hf_config,
)
from tokenmill_service.worker.models.hf_loader import rope_type
from tokenmill_service.worker.models.params import LayerParams
from tokenmill_service.worker.models.qwen3 import QK_NORM_NAMES, HeadNormedAttention
from tokenmill_service.worker.models.registry import register_family
from tokenmill_service.worker.models.spec import ConfigReader, FamilySpec, GGUFField, Names, Tensors


class Gemma3Attention(HeadNormedAttention, Gemma2Attention):
    """Gemma 2's, q and k normed per head before rotary (the native stack runs it as Qwen3's)."""

    def __init__(self, p: LayerParams) -> None:
        super().__init__(p)
        act_dtype, config = self.qkv_proj.quant.act_dtype, p.config
        self.q_norm = gemma_norm(config, config.head_dim, p.ops, act_dtype)
        self.k_norm = gemma_norm(config, config.head_dim, p.ops, act_dtype)


def scaled_rotary(config: ModelConfig, theta: float, linear_factor: float, ops: Ops) -> RotaryEmbedding:
    """Rotary tables for ``theta``, the frequencies divided by ``linear_factor`` (linear RoPE scaling)."""
    rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings, theta, None, ops)
    if linear_factor != 1.0:
        inv_freq = 1.0 / (theta ** (torch.arange(0, config.head_dim, 2, dtype=torch.float64) / config.head_dim))
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(positions, (inv_freq / linear_factor).float())
        rotary.cos, rotary.sin = freqs.cos(), freqs.sin()
    return rotary


class Gemma3Model(GemmaModel):
    def __init__(self, config: ModelConfig, ops: Ops, *args: Any) -> None:
        super().__init__(config, ops, *args)
        # Global layers rotate with the tables of make_rotary; local ones share theirs.
        local = scaled_rotary(config, cast(float, config.extra["rope_local_theta"]), 1.0, ops)
        for layer, kind in zip(self.layers, cast(list[str], config.extra["layer_types"])):
            if kind == SLIDING:
                cast(DecoderAttention, layer.self_attn).rotary = local

    def make_rotary(self, config: ModelConfig, ops: Ops) -> RotaryEmbedding:
        return scaled_rotary(config, config.rope_theta, cast(float, config.extra["rope_linear_factor"]), ops)


def _global_rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """(rope_theta, scaling parameters) of the global layers, from either config.json layout."""
    params = raw.get("rope_parameters") or {}
    if "full_attention" in params:  # transformers 5: one entry per layer type
        full = params["full_attention"] or {}
        return float(full.get("rope_theta", 1_000_000.0)), full
    return float(raw.get("rope_theta", params.get("rope_theta", 1_000_000.0))), raw.get("rope_scaling") or params


def _local_theta(raw: dict[str, Any]) -> float:
    params = raw.get("rope_parameters") or {}
    local = params.get("sliding_attention") or {}
    return float(local.get("rope_theta", raw.get("rope_local_base_freq", 10_000.0)))


def _linear_factor(params: dict[str, Any]) -> float:
    kind = rope_type(params)
    if kind == "default":
        return 1.0
    if kind != "linear":
        raise ValueError(f"RoPE scaling type {kind!r} is not supported for Gemma 3 (supported: linear)")
    return float(params["factor"])


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    attention_type: ClassVar[type[DecoderAttention]] = Gemma3Attention
    model_type: ClassVar[type[DecoderModel]] = Gemma3Model


def _read_hf(raw: dict[str, Any], hf_architecture: str, config: ModelConfig) -> None:
    defaults = {
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "final_logit_softcapping": None,
    }
    pattern = int(raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or 6)
    read_gemma_hf_config(raw, config, defaults, pattern)
    config.extra["attn_logit_softcapping"] = None  # transformers' Gemma 3 attention never applies it
    config.rope_theta, params = _global_rope(raw)
    config.extra["rope_linear_factor"] = _linear_factor(params)
    config.extra["rope_local_theta"] = _local_theta(raw)


def _read_gguf(field: GGUFField, gguf_architecture: str, config: ModelConfig) -> None:
    arch = gguf_architecture
    read_gemma_gguf_config(field, arch, config, window=None, pattern=6, big=62)
    config.extra["attn_logit_softcapping"] = None
    final = field(f"{arch}.final_logit_softcapping")
    config.extra["final_logit_softcapping"] = float(final) if final else None
    scaling = field(f"{arch}.rope.scaling.type")
    config.extra["rope_linear_factor"] = float(field(f"{arch}.rope.scaling.factor")) if scaling == "linear" else 1.0
    local = field(f"{arch}.rope.freq_base_swa")
    config.extra["rope_local_theta"] = float(local) if local else 10_000.0


GEMMA3 = register_family(
    FamilySpec(
        ("gemma3",),
        Gemma3ForCausalLM,
        Names({"Gemma3ForCausalLM": "gemma3"}, {"gemma3": "gemma3"}),
        ConfigReader(
            _read_hf,
            _read_gguf,
            hf_activation=GEMMA_HF_ACTIVATION,
            hf_rope_types=frozenset({"linear"}),
            gguf_rope_types=frozenset({"linear"}),
        ),
        Tensors(gguf_layer={**GEMMA_GGUF_LAYER_NAMES, **QK_NORM_NAMES}),
        # transformers' Gemma 3 attention soft-caps no score.
        dataclasses.replace(GEMMA_FACTS, qk_norm="heads", attention_softcap=False),
    )
)
