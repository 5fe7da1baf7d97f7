"""Llama 2/3 (SmolLM2, ...), Mistral and Qwen2: the plain decoder (worker/models/decoder.py) under three specs.

A Llama-shaped family is one file like this: its spec (names, how it reads its config, its facts)
registered with the decoder as its module, or with a subclass of it where a seam differs (qwen3.py:
q/k norms; granite.py: multipliers).
"""

from __future__ import annotations

from typing import Any

from tokenmill_service.worker.models.config import ModelConfig
from tokenmill_service.worker.models.decoder import DecoderForCausalLM
from tokenmill_service.worker.models.registry import family, register_family
from tokenmill_service.worker.models.spec import ConfigReader, Facts, FamilySpec, GGUFField, Names, SlidingWindows


def _read_gguf_llama(field: GGUFField, gguf_architecture: str, config: ModelConfig) -> None:
    if gguf_architecture == "llama" and field("llama.expert_count"):
        # llama.cpp writes Mixtral as a "llama" GGUF with experts: it runs as the mixtral family.
        config.architecture = "mixtral"
        family("mixtral").config.gguf(field, gguf_architecture, config)


def _read_qwen2(raw: dict[str, Any], hf_architecture: str, config: ModelConfig) -> None:
    config.attention_bias = True  # always there, never declared


# Tools write "mistral" for Mistral's llama-shaped GGUFs (llama.cpp itself converts them as "llama").
LLAMA = register_family(
    FamilySpec(
        ("llama",),
        DecoderForCausalLM,
        Names({"LlamaForCausalLM": "llama"}, {"llama": "llama", "mistral": "llama"}, frozenset({"llama", "mistral"})),
        ConfigReader(gguf=_read_gguf_llama),
    )
)
# Mistral is Llama with a window on every layer (MistralConfig's default 4096; null: none).
MISTRAL = register_family(
    FamilySpec(
        ("mistral",),
        DecoderForCausalLM,
        Names({"MistralForCausalLM": "mistral"}),
        ConfigReader(windows=SlidingWindows(default=4096)),
        facts=Facts(sliding_windows=True),
    )
)
# Qwen2 is Llama with q/k/v biases, and windows from max_window_layers on where use_sliding_window says.
QWEN2 = register_family(
    FamilySpec(
        ("qwen2",),
        DecoderForCausalLM,
        Names({"Qwen2ForCausalLM": "qwen2"}, {"qwen2": "qwen2"}),
        ConfigReader(hf=_read_qwen2, windows=SlidingWindows(every_layer=False, flagged=True, default=4096)),
        facts=Facts(sliding_windows=True),
    )
)
