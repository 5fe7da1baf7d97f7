"""Phi-3 / Phi-4-mini (``Phi3ForCausalLM``): a Llama-family decoder with fused checkpoint tensors and,
where configured, partial rotary and LongRoPE (transformers' modeling_phi3.py).

- The checkpoint holds ``self_attn.qkv_proj`` ([q; k; v] rows) and ``mlp.gate_up_proj`` ([gate; up]
  rows) whole; ``unfuse`` names the rows of each piece, the loaders cut them and ``load_weights``
  packs them into the model's own ``qkv_proj`` / ``gate_up_proj`` as for any Llama checkpoint (so
  tensor parallelism shards q, k, v, gate and up each as usual).
- ``partial_rotary_factor`` (Phi-4-mini: 0.75) rotates only the first ``head_dim * factor`` dims of
  each head; the rest pass through (``Phi3RotaryEmbedding``).
- LongRoPE (``rope_scaling`` type ``longrope``, or the older ``su``): transformers switches *every*
  position from the short to the long factors once a sequence outgrows
  ``original_max_position_embeddings``, which would re-rotate keys already in a KV cache and make a
  sequence's results depend on when it crossed that length. As llama.cpp does, the factors are chosen
  once, by the served context (``--max-model-len``, else the model's own), in the load plan
  (``rope_choice``): past the original length the long factors rotate every position (transformers'
  numbers for any sequence longer than the original); within it the short factors, and the context is
  capped at the original length. Either way cos/sin are scaled by the attention factor
  (sqrt(1 + ln(scale) / ln(original)), scale = max positions / original, unless the config gives one).
- ``sliding_window`` (Phi-3-mini-4k: 2047) applies to every layer, as transformers' mask does; the
  attention kernels take it per layer (worker/models/config.py ``layer_window``), the context is not capped.

GGUF (llama.cpp's ``phi3``, as convert_hf_to_gguf.py writes it): the fused tensors are ``attn_qkv`` and
``ffn_up`` (gate and up rows, in that order), split by ``unfuse`` as the Hugging Face ones; q/k rows are
not permuted; ``rope.dimension_count`` gives the rotary dims, the LongRoPE factors are the tensors
``rope_factors_short`` / ``rope_factors_long`` (the loader folds them into the config) with
``rope.scaling.attn_factor`` and ``rope.scaling.original_context_length``.

The native decoder stack runs Phi-3's layers: it rotates the first ``rotary_dim`` dims of each head
(``Phi3RotaryEmbedding.rotary_dim``; elementwise.cpp's rotary, which the eager path calls on the same
views) from the one table the load plan's LongRoPE choice gave the model, which no step changes.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import structlog
import torch

from tokenmill_service.worker.kernels.interface import Ops
from tokenmill_service.worker.layers.rotary import RotaryEmbedding
from tokenmill_service.worker.models.config import ModelConfig
from tokenmill_service.worker.models.decoder import DecoderForCausalLM, DecoderModel
from tokenmill_service.worker.models.hf_loader import rope_params, rope_type
from tokenmill_service.worker.models.registry import register_family
from tokenmill_service.worker.models.spec import (
    GGUF_LAYER_NAMES,
    ConfigReader,
    Facts,
    FamilySpec,
    GGUFField,
    Names,
    SlidingWindows,
    Tensors,
)

log = structlog.get_logger(__name__)

# transformers' Phi3Config reads "su" and "yarn" as LongRoPE (the names earlier Phi-3 configs wrote).
LONGROPE_TYPES = frozenset({"longrope", "su", "yarn"})


class Phi3RotaryEmbedding(RotaryEmbedding):
    """Rotates the first ``rotary_dim`` dims of each head (two halves, Hugging Face's layout); the rest
    pass through. ``factors`` (LongRoPE's short or long factors) divide the frequencies, ``attention_factor``
    scales cos and sin, as transformers' ``_compute_longrope_parameters`` and Phi3RotaryEmbedding do."""

    def __init__(
        self,
        head_dim: int,
        rotary_dim: int,
        max_positions: int,
        theta: float,
        factors: list[float] | None,
        attention_factor: float,
        ops: Ops,
    ) -> None:
        super().__init__(rotary_dim, max_positions, theta, None, ops)
        self.head_dim, self.rotary_dim = head_dim, rotary_dim
        inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
        if factors is not None:
            inv_freq = inv_freq / torch.tensor(factors, dtype=torch.float64)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq.float())
        self.cos, self.sin = freqs.cos() * attention_factor, freqs.sin() * attention_factor

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.rotary_dim == self.head_dim:
            return self.ops.rotary(q, k, positions, self.cos, self.sin)
        r = self.rotary_dim
        # Views of the rotated part; an op may rotate them in place, the pass-through part is untouched.
        q_rot, k_rot = self.ops.rotary(q[..., :r], k[..., :r], positions, self.cos, self.sin)
        return torch.cat([q_rot, q[..., r:]], dim=-1), torch.cat([k_rot, k[..., r:]], dim=-1)


class Phi3Model(DecoderModel):
    def make_rotary(self, config: ModelConfig, ops: Ops) -> RotaryEmbedding:
        # The factors the load plan chose (``with_rope``); LongRoPE's short ones for a model built without it.
        chosen = config.extra.get("rope_factors", config.extra.get("rope_short_factor"))
        factors: list[float] | None = chosen  # type: ignore[assignment]
        return Phi3RotaryEmbedding(
            config.head_dim,
            int(config.extra["rotary_dim"]),  # type: ignore[call-overload]
            config.max_position_embeddings,
            config.rope_theta,
            factors,
            float(config.extra.get("rope_attention_factor", 1.0)),  # type: ignore[arg-type]
            ops,
        )


def _cap_context(config: ModelConfig, limit: int, why: str) -> None:
    if limit < config.max_position_embeddings:
        log.info("context_capped", reason=why, limit=limit, max_positions=config.max_position_embeddings)
        config.max_position_embeddings = limit


def _set_rotary_dim(config: ModelConfig, rotary_dim: int, source: str) -> None:
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > config.head_dim:
        raise ValueError(f"{source} gives {rotary_dim} rotary dims of a {config.head_dim} head")
    config.extra["rotary_dim"] = rotary_dim


def _set_longrope(
    config: ModelConfig, short: list[float], long: list[float] | None, original: int, attention_factor: float
) -> None:
    """LongRoPE's factors, original length and attention factor, for the load plan to choose from."""
    rotary_dim = int(config.extra["rotary_dim"])  # type: ignore[call-overload]
    for name, factors in (("short_factor", short), ("long_factor", long)):
        if factors is not None and len(factors) != rotary_dim // 2:
            raise ValueError(f"LongRoPE {name} has {len(factors)} values, not {rotary_dim // 2} (rotary dims / 2)")
    config.extra["rope_short_factor"] = short
    config.extra["rope_long_factor"] = long
    config.extra["rope_original_max_positions"] = original
    config.extra["rope_attention_factor"] = attention_factor


SHORT, LONG = "short-factors", "long-factors"


# llama.cpp's names of Phi-3's fused tensors: split by ``unfuse`` as the Hugging Face ones are.
PHI3_GGUF_LAYER_NAMES = {**GGUF_LAYER_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}


class Phi3ForCausalLM(DecoderForCausalLM):
    model_type = Phi3Model


def _read_hf(raw: dict[str, Any], hf_architecture: str, config: ModelConfig) -> None:
    params = rope_params(raw)
    factor = float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
    _set_rotary_dim(config, int(config.head_dim * factor), f"partial_rotary_factor {factor}")
    if rope_type(params) in LONGROPE_TYPES:
        _read_longrope(raw, params, config)


def _read_longrope(raw: dict[str, Any], params: dict[str, Any], config: ModelConfig) -> None:
    original = int(
        params.get("original_max_position_embeddings")
        or raw.get("original_max_position_embeddings")
        or config.max_position_embeddings
    )
    # transformers: the default factor is the ratio of the two lengths, the attention factor from it.
    factor = params.get("factor") or config.max_position_embeddings / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    long = params.get("long_factor")
    _set_longrope(
        config,
        [float(f) for f in params.get("short_factor") or []],
        None if long is None else [float(f) for f in long],
        original,
        float(attention_factor),
    )


def _read_gguf(field: GGUFField, gguf_architecture: str, config: ModelConfig) -> None:
    """llama.cpp's ``phi3``: ``rope.dimension_count`` the rotary dims, ``attention.sliding_window``
    (0: none, as Phi-4 writes), and for LongRoPE the ``rope_factors_short/long`` tensors (in
    ``extra`` already) with ``rope.scaling.attn_factor`` and ``rope.scaling.original_context_length``."""
    arch = gguf_architecture
    rope_dims = field(f"{arch}.rope.dimension_count")
    _set_rotary_dim(config, int(rope_dims or config.head_dim), f"rope.dimension_count {rope_dims}")
    window = field(f"{arch}.attention.sliding_window")
    if window:
        config.extra["sliding_window"] = int(window)
    scaling_type = field(f"{arch}.rope.scaling.type")
    if scaling_type not in (None, "none"):
        raise ValueError(f"RoPE scaling type {scaling_type!r} is not supported for phi3")
    short = config.extra.pop("rope_short_factor", None)
    long = config.extra.pop("rope_long_factor", None)
    if long is None:
        return  # no LongRoPE: plain rotary over the whole context
    if short is None:
        raise ValueError("the GGUF has rope_factors_long but no rope_factors_short")
    original = int(field(f"{arch}.rope.scaling.original_context_length") or config.max_position_embeddings)
    attention_factor = float(field(f"{arch}.rope.scaling.attn_factor") or 1.0)
    _set_longrope(config, list(short), list(long), original, attention_factor)  # type: ignore[call-overload]


def rope_choice(config: ModelConfig, max_model_len: int) -> tuple[str, str] | None:
    """LongRoPE's factors for the served context (``max_model_len``; 0: the model's own), as llama.cpp
    chooses them: the long ones for every position when it exceeds the original length, else the
    short ones, with the reason (the plan's ``rope`` decision). None: no LongRoPE."""
    if config.extra.get("rope_short_factor") is None:
        return None
    original = int(config.extra["rope_original_max_positions"])  # type: ignore[call-overload]
    own = config.max_position_embeddings
    served = min(max_model_len or own, own)
    asked = f"--max-model-len {max_model_len}" if max_model_len else "the model's own"
    scale = f"cos/sin scaled by {float(config.extra['rope_attention_factor']):.6g}"  # type: ignore[arg-type]
    if served <= original:
        return (
            SHORT,
            f"LongRoPE: the served context ({asked}: {served}) is within the original {original} positions; {scale}",
        )
    if config.extra.get("rope_long_factor") is None:
        return (
            SHORT,
            f"LongRoPE without long factors: the context is capped at the original {original} positions; {scale}",
        )
    return (
        LONG,
        (
            f"LongRoPE: the served context ({asked}: {served}) exceeds the original {original} "
            f"positions: the long factors at every position; {scale}"
        ),
    )


def with_rope(config: ModelConfig, choice: str) -> ModelConfig:
    """``config`` with the factors the plan chose (``rope_choice``); the short ones cap the context at
    the original length (logged)."""
    long = choice == LONG
    out = dataclasses.replace(config, extra={**config.extra})
    out.extra["rope_factors"] = config.extra["rope_long_factor" if long else "rope_short_factor"]
    if not long:
        original = int(config.extra["rope_original_max_positions"])  # type: ignore[call-overload]
        _cap_context(out, original, "longrope_short_factors")
    return out


def _unfuse(name: str, config: ModelConfig) -> list[tuple[str, int, int]] | None:
    parent, _, leaf = name.rpartition(".")  # "model.layers.N.self_attn.qkv_proj", "weight"
    layer, _, fused = parent.rpartition(".")
    if leaf != "weight":
        return None
    if fused == "qkv_proj":
        q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        return [
            (f"{layer}.q_proj.weight", 0, q),
            (f"{layer}.k_proj.weight", q, kv),
            (f"{layer}.v_proj.weight", q + kv, kv),
        ]
    if fused == "gate_up_proj":
        size = config.intermediate_size
        return [(f"{layer}.gate_proj.weight", 0, size), (f"{layer}.up_proj.weight", size, size)]
    return None


PHI3 = register_family(
    FamilySpec(
        ("phi3",),
        Phi3ForCausalLM,
        Names({"Phi3ForCausalLM": "phi3"}, {"phi3": "phi3"}),  # the converter writes q/k rows as they are
        ConfigReader(
            _read_hf,
            _read_gguf,
            hf_rope_types=LONGROPE_TYPES,
            gguf_reads_attention=True,  # partial rotary (rope.dimension_count) is read here
            gguf_config_tensors={
                "rope_factors_short.weight": "rope_short_factor",
                "rope_factors_long.weight": "rope_long_factor",
            },
            windows=SlidingWindows(),
        ),
        Tensors(gguf_layer=PHI3_GGUF_LAYER_NAMES, unfuse=_unfuse),
        Facts(sliding_windows=True),
        rope_choice=rope_choice,
        with_rope=with_rope,
    )
)
