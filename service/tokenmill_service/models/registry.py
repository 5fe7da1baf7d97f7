"""Model families by the architecture a checkpoint declares (``ModelConfig.architecture``).

A family registers its ``nn.Module`` class here (``@register_model("llama", "mistral", "qwen2")``)
and says which linear layers it has (``linear_prefixes``), so the load plan can choose a method for
each before the model is built. The families that ship with tokenmill are listed once, in
``BUILTIN_FAMILIES``, and imported on the first lookup.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, Protocol

from tokenmill_service.models.config import ModelConfig


class ModelFamily(Protocol):
    @classmethod
    def linear_prefixes(cls, config: ModelConfig) -> list[str]:
        """Every linear layer's prefix, as the model's quant factory will be asked for them."""
        ...


_FAMILIES: dict[str, type] = {}

# The modules whose classes register the built-in families; imported lazily, as they import torch.
BUILTIN_FAMILIES = ("tokenmill_service.models.llama", "tokenmill_service.models.qwen3")


def register_model(*architectures: str) -> Callable[[type], type]:
    def wrap(cls: type) -> type:
        for arch in architectures:
            _FAMILIES[arch] = cls
        return cls

    return wrap


def model_class(architecture: str) -> type[Any]:
    """The family registered for ``architecture`` (ValueError naming those that are otherwise)."""
    for module in BUILTIN_FAMILIES:
        importlib.import_module(module)  # registers its families (once: imports are cached)
    try:
        return _FAMILIES[architecture]
    except KeyError:
        raise ValueError(
            f"architecture {architecture!r} has no model here (registered: {', '.join(sorted(_FAMILIES))})"
        ) from None
