"""Mixtral (transformers' modeling_mixtral.py): Llama attention, every layer's MLP a mixture of
experts, the top ``num_experts_per_tok`` of ``num_local_experts`` by softmax, renormalized.

Hugging Face checkpoints name the layer ``block_sparse_moe`` and each expert's projections ``w1``
(gate), ``w3`` (up) and ``w2`` (down); they are read under worker/models/moe.py's names. llama.cpp writes
Mixtral as a "llama" GGUF with ``llama.expert_count`` (llama.py sends it here), q/k permuted as
for Llama, ``feed_forward_length`` the experts' width. ``sliding_window`` applies to every layer.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from tokenmill_service.worker.models.config import ModelConfig
from tokenmill_service.worker.models.moe import MOE_FACTS, MoEForCausalLM, moe_tensors, set_moe, unfuse_stacked
from tokenmill_service.worker.models.registry import register_family
from tokenmill_service.worker.models.spec import ConfigReader, FamilySpec, GGUFField, Names, SlidingWindows

_HF_NAME = re.compile(r"(model\.layers\.\d+\.)block_sparse_moe\.(gate|experts\.\d+\.(w1|w2|w3))\.weight")
_EXPERT_PROJECTIONS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _read_hf(raw: dict[str, Any], hf_architecture: str, config: ModelConfig) -> None:
    experts = int(raw["num_local_experts"])
    set_moe(config, experts, int(raw["num_experts_per_tok"]), config.intermediate_size, True, range(config.num_layers))


def _read_gguf(field: GGUFField, gguf_architecture: str, config: ModelConfig) -> None:
    experts, per_token = int(field("llama.expert_count")), int(field("llama.expert_used_count") or 0)
    set_moe(config, experts, per_token, config.intermediate_size, True, range(config.num_layers))


def _unfuse(name: str, config: ModelConfig) -> list[tuple[str, int, int]] | None:
    match = _HF_NAME.fullmatch(name)
    if match is None:
        return unfuse_stacked(name, config)
    layer, part, projection = match.groups()
    if projection is not None:
        part = part.removesuffix(projection) + _EXPERT_PROJECTIONS[projection]
    return [(f"{layer}mlp.{part}.weight", 0, -1)]


# No GGUF name of its own: llama.cpp writes it as "llama" with experts (llama.py's reader sends it here).
MIXTRAL = register_family(
    FamilySpec(
        ("mixtral",),
        MoEForCausalLM,
        Names({"MixtralForCausalLM": "mixtral"}, {}, frozenset({"llama"})),
        ConfigReader(_read_hf, _read_gguf, windows=SlidingWindows()),
        dataclasses.replace(moe_tensors(), unfuse=_unfuse),
        MOE_FACTS,
    )
)
