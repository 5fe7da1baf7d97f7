"""How the runner runs a forward pass, chosen by the load plan (``LoadPlan.executor``):

- ``eager``: the model's own loop, layer by layer, from Python;
- ``native-stack``: the decoder layers and final norm in one native call (worker/engine/native_stack.py);
- ``compiled``: the model's regions between attention calls through torch.compile (worker/engine/compile.py).

All three give a sequence the same tokens; eager and native-stack the same bits. The model stays a
plain module: an executor wraps it and never changes it.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any, Protocol

import torch

from tokenmill_service.worker.engine.causal_lm import CausalLM
from tokenmill_service.worker.kernels.attention_metadata import AttentionMetadata


class Executor(Protocol):
    kind: str

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [T, hidden] of a flat batch of T new tokens."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


class EagerExecutor:
    kind = "eager"

    def __init__(self, model: CausalLM) -> None:
        self.model = model

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)


# Compiled regions by family: a region is a function of (module, tensors), so one compilation
# serves every model of the family in the process (and a new runner builds no new graphs).
_COMPILED: dict[type[Any], Any] = {}


class CompiledExecutor:
    """The model's regions (``model.regions_type``) each through ``compiled_region``."""

    kind = "compiled"

    def __init__(self, model: CausalLM) -> None:
        from tokenmill_service.worker.engine.compile import compiled_region, configure_inductor

        self.model = model
        kind = model.regions_type
        if kind not in _COMPILED:
            configure_inductor()
            plain = kind()
            _COMPILED[kind] = kind(*(compiled_region(getattr(plain, f.name)) for f in fields(plain)))
        self.regions = _COMPILED[kind]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta, self.regions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden, self.regions)


def make_executor(model: CausalLM, kind: str | None = None) -> Executor:
    """The executor ``kind`` for ``model``; None: the one its load plan chose (eager without a plan)."""
    if kind is None:
        kind = model.plan.executor.value if model.plan is not None else "eager"
    if kind == "native-stack":
        from tokenmill_service.worker.engine.native_stack import NativeStackExecutor

        return NativeStackExecutor(model)
    if kind == "compiled":
        return CompiledExecutor(model)
    if kind == "eager":
        return EagerExecutor(model)
    raise ValueError(f"unknown executor {kind!r} (eager, native-stack, compiled)")
