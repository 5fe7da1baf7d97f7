"""Model families by the architecture a checkpoint declares (``ModelConfig.architecture``).

A family registers its ``nn.Module`` class here (``@register_model("llama", "mistral", "qwen2")``)
and declares, on the class, everything the loaders need to know about it: the Hugging Face
``architectures`` and GGUF ``general.architecture`` names it runs (``hf_architectures``,
``gguf_architectures``), llama.cpp's tensor names (``gguf_layer_names``), the config keys of its own
(``read_hf_config``, ``read_gguf_config``), checkpoint tensors that hold several layers' weights
(``unfuse``), and which linear layers it has (``linear_prefixes``), so the load plan can choose a method
for each before the model is built. The loaders ask this registry; they know no family by name.

The families that ship with tokenmill are listed once, in ``BUILTIN_FAMILIES``, and imported on
the first lookup: adding a family is its own file and one line there.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, ClassVar, Protocol

from tokenmill_service.models.config import ModelConfig


class ModelFamily(Protocol):
    # Hugging Face ``architectures`` entry -> the registered name it runs as (declared on the class itself).
    hf_architectures: ClassVar[dict[str, str]]
    # GGUF ``general.architecture`` -> the registered name it runs as (declared on the class itself).
    gguf_architectures: ClassVar[dict[str, str]]

    @classmethod
    def linear_prefixes(cls, config: ModelConfig) -> list[str]:
        """Every linear layer's prefix, as the model's quant factory will be asked for them."""
        ...


_FAMILIES: dict[str, type] = {}
_HF_NAMES: dict[str, str] = {}
_GGUF_NAMES: dict[str, str] = {}

# The modules whose classes register the built-in families; imported lazily, as they import torch.
BUILTIN_FAMILIES = (
    "tokenmill_service.models.llama",
    "tokenmill_service.models.qwen3",
    "tokenmill_service.models.granite",
    "tokenmill_service.models.phi3",
    "tokenmill_service.models.gemma2",
    "tokenmill_service.models.gemma3",
    "tokenmill_service.models.deepseek_v3",
    "tokenmill_service.models.mixtral",
    "tokenmill_service.models.qwen3_moe",
    "tokenmill_service.models.olmoe",
    "tokenmill_service.models.gpt_oss",
)


def register_model(*architectures: str) -> Callable[[type], type]:
    """Class decorator: ``cls`` runs checkpoints of ``architectures`` and of the Hugging Face and GGUF
    names it declares. A name another family (or this one) already holds is refused (ValueError)."""

    def wrap(cls: type) -> type:
        # Only what the class itself declares: a subclass must name its own checkpoints, not inherit
        # its parent's (which would be a clash).
        hf: dict[str, str] = dict(vars(cls).get("hf_architectures", {}))
        gguf: dict[str, str] = dict(vars(cls).get("gguf_architectures", {}))
        for kind, names, table in (
            ("architecture", dict.fromkeys(architectures, ""), _FAMILIES),
            ("Hugging Face architecture", hf, _HF_NAMES),
            ("GGUF architecture", gguf, _GGUF_NAMES),
        ):
            for name in names:
                if name in table:
                    raise ValueError(f"{kind} {name!r} is already registered; {cls.__name__} cannot take it")
        for target in (*hf.values(), *gguf.values()):
            if target not in architectures:
                raise ValueError(f"{cls.__name__} maps a checkpoint to {target!r}, which it does not register")
        for arch in architectures:
            _FAMILIES[arch] = cls
        _HF_NAMES.update(hf)
        _GGUF_NAMES.update(gguf)
        return cls

    return wrap


def _import_builtins() -> None:
    for module in BUILTIN_FAMILIES:
        importlib.import_module(module)  # registers its families (once: imports are cached)


def model_class(architecture: str) -> type[Any]:
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


def unfused(family: Any, name: str, config: ModelConfig) -> list[tuple[str, int, int]]:
    """The (name, first row, rows) pieces a checkpoint tensor holds: itself whole, or the layers a
    fused tensor packs (``family.unfuse``), which the loaders cut from it by rows."""
    pieces: list[tuple[str, int, int]] | None = family.unfuse(name, config)
    return [(name, 0, -1)] if pieces is None else pieces
