"""A model family's contract: ``FamilySpec``, what the loaders, the plan and the native stack know of it.

A family is two things side by side: this typed spec (its names, how it reads its config, its tensor
names, the facts the plan and the native decoder stack read) and its compute-only module (an
``nn.Module`` built from ``layers/``). Nothing asks a family anything else; nothing probes its module
for settings (worker/models/registry.py maps architectures to specs; worker/models/builder.py builds any spec's module).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from gguf import GGMLQuantizationType as QType

from tokenmill_service.worker.models.config import FULL, SLIDING, ModelConfig

# A GGUF metadata lookup: ``field(key)``, None where the file has no such key.
GGUFField = Callable[[str], Any]
# What a family does to q and k before rotary (the native stack's abi.QK_NORM_MODES): nothing, an RMSNorm
# of each token's whole q and k projections (OLMoE's, OLMo 2's), or of each head (Qwen3's, Gemma 3's).
QKNorm = Literal["none", "whole", "heads"]
# Where a layer's norms are: before attention and the MLP (Llama's), also after each (Gemma's "sandwich":
# attention's and the MLP's outputs normed before their residual add), or only after each (OLMo 2's).
NormPlacement = Literal["pre", "sandwich", "post"]

# llama.cpp's names (convert_hf_to_gguf.py) of the tensors outside the layers, and of a layer's parts.
GGUF_GLOBAL_NAMES: Mapping[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
GGUF_LAYER_NAMES: Mapping[str, str] = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def read_nothing(*_: Any) -> None:
    """A family that reads nothing beyond the common keys."""


def dense_linear_prefixes(config: ModelConfig) -> list[str]:
    """Every linear layer of a dense Llama-shaped decoder, as ``quant`` is asked for them (packed q/k/v, gate/up)."""
    leaves = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
    return [f"model.layers.{i}.{leaf}" for i in range(config.num_layers) for leaf in leaves] + ["lm_head"]


def not_fused(name: str, config: ModelConfig) -> list[tuple[str, int, int]] | None:
    return None


def all_float(config: ModelConfig) -> dict[str, QType]:
    return {}


def per_head_cache(config: ModelConfig, tensor_parallel: int = 1) -> tuple[int, int]:
    """Values one token of context caches on a rank (a key and a value per layer for each of its key/value
    heads), and those of a per-head cache, for comparison with families that cache less (the same here)."""
    kv_heads = max(1, config.num_kv_heads // tensor_parallel)
    values = config.num_layers * 2 * kv_heads * config.head_dim
    return values, values


def served(config: ModelConfig) -> str | None:
    return None


def same_rope(config: ModelConfig, choice: str) -> ModelConfig:
    return config


@dataclass(frozen=True, slots=True)
class SlidingWindows:
    """How transformers applies ``sliding_window`` for the family (its configuration and modeling files).

    ``flagged``: only with ``use_sliding_window`` (Qwen2's, Qwen3's); ``every_layer``: to every layer (else
    to the layers ``layer_types`` marks, or from ``max_window_layers`` on); ``default``: the window where
    config.json has no such key (MistralConfig's 4096; None: none)."""

    every_layer: bool = True
    flagged: bool = False
    default: int | None = None

    def read(self, raw: dict[str, Any], config: ModelConfig) -> None:
        if self.flagged and not raw.get("use_sliding_window", False):
            return
        window = raw.get("sliding_window", self.default)
        if self.flagged and not self.every_layer:
            if not window:
                return
            first = int(raw.get("max_window_layers", 28))
            types = raw.get("layer_types") or [SLIDING if i >= first else FULL for i in range(config.num_layers)]
            config.extra["layer_types"] = list(types)
        if window:
            config.extra["sliding_window"] = int(window)


@dataclass(frozen=True, slots=True)
class Names:
    """The checkpoints a family runs: Hugging Face ``architectures`` and GGUF ``general.architecture``
    names -> the registered architecture they run as."""

    hf: Mapping[str, str]
    gguf: Mapping[str, str] = field(default_factory=dict)
    # GGUF architectures whose q/k rows llama.cpp's converter permuted for ggml's pairwise RoPE.
    gguf_permuted: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class ConfigReader:
    """How the family reads its config beyond the common keys (the loaders read those)."""

    # config.json: (raw, the Hugging Face architecture, the config to complete); ValueError: refused.
    hf: Callable[[dict[str, Any], str, ModelConfig], None] = read_nothing
    # GGUF metadata: (field, the GGUF architecture, the config to complete); ValueError: refused.
    gguf: Callable[[GGUFField, str, ModelConfig], None] = read_nothing
    # The config.json key naming the MLP's activation, and the one activation the family runs.
    hf_activation: tuple[str, str] = ("hidden_act", "silu")
    # ``rope_scaling`` types the family reads itself; the loader reads only llama3's.
    hf_rope_types: frozenset[str] = frozenset()
    # GGUF ``rope.scaling.type`` values the family reads itself; the loader none.
    gguf_rope_types: frozenset[str] = frozenset()
    # The family reads its GGUF head sizes and RoPE scaling itself (Phi-3's partial rotary, DeepSeek's MLA).
    gguf_reads_attention: bool = False
    # GGUF tensors that hold a setting, not weights -> the ``config.extra`` key their values go to.
    gguf_config_tensors: Mapping[str, str] = field(default_factory=dict)
    # Its sliding windows as transformers applies them (read before ``hf``); None: none, or ``hf`` reads them.
    windows: SlidingWindows | None = None

    def read_hf(self, raw: dict[str, Any], hf_architecture: str, config: ModelConfig) -> None:
        if self.windows is not None:
            self.windows.read(raw, config)
        self.hf(raw, hf_architecture, config)


@dataclass(frozen=True, slots=True)
class Tensors:
    """The family's checkpoint tensors and linear layers."""

    # llama.cpp's tensor names -> the model's: outside the layers, and a layer's part (``blk.N.<part>``).
    gguf_global: Mapping[str, str] = field(default_factory=lambda: GGUF_GLOBAL_NAMES)
    gguf_layer: Mapping[str, str] = field(default_factory=lambda: GGUF_LAYER_NAMES)
    # Every linear layer's prefix, as the model's quant factory will be asked for them.
    linear_prefixes: Callable[[ModelConfig], list[str]] = dense_linear_prefixes
    # Those of the multi-token-prediction layers it serves (None: it has none).
    mtp_linear_prefixes: Callable[[ModelConfig], list[str]] | None = None
    # The layers a fused checkpoint tensor packs, as (name, first row, rows); None: not fused.
    unfuse: Callable[[str, ModelConfig], list[tuple[str, int, int]] | None] = not_fused
    # The safetensors tensors it reads as GGUF-style blocks, by name (none: all float).
    hf_stored_types: Callable[[ModelConfig], dict[str, QType]] = all_float
    # Projections absorbed at load, never applied by their kernel (DeepSeek's kv_b_proj).
    absorbed: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class Facts:
    """What the plan and the native decoder stack need to know of the family's layers."""

    norms: NormPlacement = "pre"
    qk_norm: QKNorm = "none"
    # The MLP's activation as the native stack names it (worker/kernels/cpu/abi.py's ACTIVATIONS).
    activation: str = "silu"
    # Each sub-layer's output times a multiplier before its residual add (Granite's).
    residual_multiplier: bool = False
    # Some layers attend within a sliding window (which, and how wide: the checkpoint's config).
    sliding_windows: bool = False
    # A mixture of experts in (some of) its layers.
    experts: bool = False
    # Multi-head latent attention: its cache is a latent per token (the backend's ``LatentCacheLayout``).
    latent_attention: bool = False
    # Attention scores soft-capped (Gemma 2's), attention sinks (gpt-oss's), logits soft-capped (Gemma 2's).
    attention_softcap: bool = False
    attention_sinks: bool = False
    logit_softcap: bool = False
    # The embeddings scaled (Gemma's by sqrt(hidden), Granite's by its multiplier): the model's own, not the stack's.
    scaled_embeddings: bool = False
    # Why the native decoder stack cannot run its layers ("": it can).
    native_stack_gap: str = ""
    # Why compiled regions cannot run it ("": they can).
    compile_gap: str = ""
    # Why its experts have no one-native-call-a-layer path ("": they have).
    native_experts_gap: str = ""


@dataclass(frozen=True, slots=True)
class FamilySpec:
    """One family: registered under ``architectures``, its compute-only ``module`` beside what it declares."""

    architectures: tuple[str, ...]
    # The nn.Module built from layers/: ``module(config, ops, quant, act_dtype=, embed_dtype=, tp=)``.
    module: type[Any]
    names: Names
    config: ConfigReader = ConfigReader()
    tensors: Tensors = Tensors()
    facts: Facts = Facts()
    # Why this checkpoint cannot be served (the plan refuses it), or None.
    unserved_reason: Callable[[ModelConfig], str | None] = served
    # Values one token of context caches on a rank, and a per-head cache's, for comparison.
    kv_cache_values_per_token: Callable[[ModelConfig, int], tuple[int, int]] = per_head_cache
    # Why the native stack cannot run this checkpoint's latent attention, or None (latent families).
    latent_stack_gap: Callable[[ModelConfig], str | None] = served
    # The rotary factors to serve ``max_model_len`` with (Phi-3's LongRoPE choice; None: no choice to make),
    # and the config with the plan's choice applied.
    rope_choice: Callable[[ModelConfig, int], tuple[str, str] | None] | None = None
    with_rope: Callable[[ModelConfig, str], ModelConfig] = same_rope


__all__ = [
    "GGUF_GLOBAL_NAMES",
    "GGUF_LAYER_NAMES",
    "ConfigReader",
    "Facts",
    "FamilySpec",
    "GGUFField",
    "Names",
    "SlidingWindows",
    "Tensors",
]
