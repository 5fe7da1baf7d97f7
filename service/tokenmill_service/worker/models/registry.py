"""Model families by the architecture a checkpoint declares (``ModelConfig.architecture``).

A family registers its spec here (``register_family(FamilySpec(...))``, worker/models/spec.py): its compute
module and everything the loaders, the plan and the native stack need to know about it: the Hugging Face
``architectures`` and GGUF ``general.architecture`` names it runs, how it reads its config, llama.cpp's
tensor names, checkpoint tensors that hold several layers' weights, which linear layers it has (so the
load plan can choose a method for each before the model is built) and the facts of its layers. The
loaders and the plan ask this registry; they know no family by name.

The families that ship with tokenmill are listed once, in ``BUILTIN_FAMILIES``, and imported on
the first lookup: adding a family is its own file and one line there.
"""

from __future__ import annotations

import importlib

from tokenmill_service.worker.models.config import ModelConfig
from tokenmill_service.worker.models.spec import FamilySpec

_FAMILIES: dict[str, FamilySpec] = {}
_HF_NAMES: dict[str, str] = {}
_GGUF_NAMES: dict[str, str] = {}

# The modules that register the built-in families; imported lazily, as they import torch.
BUILTIN_FAMILIES = (
    "tokenmill_service.worker.models.llama",
    "tokenmill_service.worker.models.qwen3",
    "tokenmill_service.worker.models.granite",
    "tokenmill_service.worker.models.phi3",
    "tokenmill_service.worker.models.gemma2",
    "tokenmill_service.worker.models.gemma3",
    "tokenmill_service.worker.models.deepseek_v3",
    "tokenmill_service.worker.models.mixtral",
    "tokenmill_service.worker.models.qwen3_moe",
    "tokenmill_service.worker.models.olmoe",
    "tokenmill_service.worker.models.olmo2",
    "tokenmill_service.worker.models.gpt_oss",
)


def register_family(spec: FamilySpec) -> FamilySpec:
    """Register ``spec``: it runs checkpoints of its architectures and of the Hugging Face and GGUF names
    it declares. A name another family (or this one) already holds is refused (ValueError), nothing registered."""
    for kind, names, table in (
        ("architecture", dict.fromkeys(spec.architectures, ""), _FAMILIES),
        ("Hugging Face architecture", spec.names.hf, _HF_NAMES),
        ("GGUF architecture", spec.names.gguf, _GGUF_NAMES),
    ):
        for name in names:
            if name in table:
                raise ValueError(f"{kind} {name!r} is already registered; {spec.module.__name__} cannot take it")
    for target in (*spec.names.hf.values(), *spec.names.gguf.values()):
        if target not in spec.architectures:
            raise ValueError(f"{spec.module.__name__} maps a checkpoint to {target!r}, which it does not register")
    for arch in spec.architectures:
        _FAMILIES[arch] = spec
    _HF_NAMES.update(spec.names.hf)
    _GGUF_NAMES.update(spec.names.gguf)
    return spec


def _import_builtins() -> None:
    for module in BUILTIN_FAMILIES:
        importlib.import_module(module)  # registers its families (once: imports are cached)


def family(architecture: str) -> FamilySpec:
    """The family registered for ``architecture`` (ValueError naming those that are otherwise)."""
    _import_builtins()
    try:
        return _FAMILIES[architecture]
    except KeyError:
        raise ValueError(
            f"architecture {architecture!r} has no model here (registered: {', '.join(sorted(_FAMILIES))})"
        ) from None


def hf_architectures() -> dict[str, str]:
    """Every Hugging Face ``architectures`` name a family runs -> its registered architecture."""
    _import_builtins()
    return dict(_HF_NAMES)


def gguf_architectures() -> dict[str, str]:
    """Every GGUF ``general.architecture`` a family runs -> its registered architecture."""
    _import_builtins()
    return dict(_GGUF_NAMES)


def unfused(spec: FamilySpec, name: str, config: ModelConfig) -> list[tuple[str, int, int]]:
    """The (name, first row, rows) pieces a checkpoint tensor holds: itself whole, or the layers a
    fused tensor packs (``spec.tensors.unfuse``), which the loaders cut from it by rows."""
    pieces = spec.tensors.unfuse(name, config)
    return [(name, 0, -1)] if pieces is None else pieces
