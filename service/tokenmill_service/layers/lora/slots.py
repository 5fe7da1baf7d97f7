"""Resident adapter slots on a model's linear layers, and the per-step batch that says who uses which.

``attach_lora(model, max_loras, max_rank)`` gives every linear layer of the decoder (not the output
head) a ``LoRALayer``: its adapters' A and B stacked in ``max_loras`` slots, for this rank's shard
as the layer shards its weight (a column-parallel layer keeps its rows of B, a row-parallel one its
columns of A; packed q/k/v and gate/up keep one block of rank per projection, B block-diagonal).
The base's weights and its quantization method are untouched: the layer adds the delta to what
its method returns (before the all-reduce of a row-parallel layer, whose partial deltas sum there).

``LoRASlots.load(slot, adapter)`` writes an adapter into a slot on this rank; the runner sets the
step's ``LoRABatch`` (which tokens use which slot) once, and every layer reads it. The grouped product
is sgmv.py's, or under ``--backend triton`` (the model's plan) the Triton kernels of
kernels/triton/lora.py, with the same signature.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tokenmill_service.layers.lora.adapter import BaseDims, LoRAAdapter, read_adapter
from tokenmill_service.layers.lora.sgmv import lora_delta

RANK_ALIGN = 32  # ranks are padded to whole blocks of the native float32 kernel
# lora_delta(x, a, b, groups, parts) -> [(rows, delta)]: layers/lora/sgmv.py's or kernels/triton/lora.py's.
DeltaFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, list[tuple[int, torch.Tensor]], list[tuple[int, int]]],
    list[tuple[torch.Tensor, torch.Tensor]],
]


@dataclass(slots=True)
class LoRABatch:
    """The step's tokens by adapter slot: (slot, token rows) for each slot in use; empty: base only."""

    groups: list[tuple[int, torch.Tensor]] = field(default_factory=list)

    def set(self, token_slots: list[int], device: torch.device) -> None:
        rows: dict[int, list[int]] = {}
        for t, slot in enumerate(token_slots):
            if slot >= 0:
                rows.setdefault(slot, []).append(t)
        self.groups = [(s, torch.tensor(r, dtype=torch.long, device=device)) for s, r in sorted(rows.items())]


class LoRALayer:
    """One linear layer's adapter slots: ``a`` [slots, P * R, in] for its P projections (3 for q/k/v, 2 for
    gate/up, else 1), ranks padded to R, and ``b`` [slots, out, R]: each output row's B against its own
    projection's block of A (``parts``: each projection's output rows, as (local start, count)), so no
    zeros of a block-diagonal B are stored, read or multiplied."""

    def __init__(
        self,
        layer: Any,
        projections: list[tuple[str, str | int | None]],
        slots: int,
        rank: int,
        batch: LoRABatch,
        delta: DeltaFn = lora_delta,
    ) -> None:
        self.projections = projections  # (checkpoint leaf, the layer's shard id) per block of rank
        self.rank = rank
        self.batch = batch
        self.delta = delta
        width = len(projections) * rank
        # Plain tensors, not buffers: the model's state (and its checkpoint loading) stays the base's.
        self.a = torch.zeros(slots, width, layer.in_features)
        self.b = torch.zeros(slots, layer.out_features, rank)
        pieces = [layer._pieces(shard) for _, shard in projections]
        assert all(len(p) == 1 for p in pieces), "a projection's rows are one range of the layer's"
        self.parts = [(local, count) for ((_, count, local),) in pieces]

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()

    def load(
        self,
        layer: Any,
        slot: int,
        prefix: str,
        adapter: LoRAAdapter,
        tensors: dict[str, tuple[torch.Tensor, torch.Tensor]],
    ) -> None:
        """Write this rank's part of the adapter's pairs for this layer (``prefix``: its parent module)."""
        self.clear(slot)
        r = adapter.rank
        for i, (leaf, shard) in enumerate(self.projections):
            pair = tensors.get(f"{prefix}.{leaf}")
            if pair is None:
                continue
            a, b = pair
            cols = slice(i * self.rank, i * self.rank + r)
            self.a[slot, cols] = layer._columns(a)
            for start, count, local in layer._pieces(shard):
                self.b[slot, local : local + count, :r] = b[start : start + count] * adapter.scale

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (the base's product of ``x``) with each adapter token's delta added."""
        for rows, delta in self.delta(x, self.a, self.b, self.batch.groups, self.parts):
            y = y.index_add(0, rows, delta.to(y.dtype))
        return y


class LoRASlots:
    """Every adapter-capable layer of a model and the step's batch they share."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int) -> None:
        from tokenmill_service.layers.linear import LinearBase

        self.max_loras, self.max_rank = max_loras, max_rank
        self.config: BaseDims = model.config  # type: ignore[assignment]
        self.batch = LoRABatch()
        rank = -(-max_rank // RANK_ALIGN) * RANK_ALIGN
        sources: dict[str, list[tuple[str, str | int | None]]] = {}
        for leaf, (packed, shard) in getattr(type(model), "packed_modules", {}).items():
            sources.setdefault(packed, []).append((leaf, shard))
        delta = lora_delta
        plan = getattr(model, "plan", None)
        if plan is not None and plan.ops.value == "triton":
            from tokenmill_service.kernels.triton.lora import lora_delta as triton_lora_delta

            delta = triton_lora_delta
        self.layers: dict[str, tuple[Any, LoRALayer]] = {}  # parent prefix -> (linear layer, its slots)
        for name, module in model.named_modules():
            if isinstance(module, LinearBase) and name.startswith("model.layers."):
                leaf = name.rpartition(".")[2]
                lora = LoRALayer(module, sources.get(leaf, [(leaf, None)]), max_loras, rank, self.batch, delta)
                module.lora = lora
                self.layers[name] = (module, lora)
        self.resident: list[str | None] = [None] * max_loras  # the adapter path in each slot

    def load(self, slot: int, name: str, path: str) -> None:
        """Write the adapter at ``path`` into ``slot`` (this rank's shard of it)."""
        self.load_adapter(slot, read_adapter(name, path, self.config, self.max_rank))

    def load_adapter(self, slot: int, adapter: LoRAAdapter) -> None:
        tensors = adapter.tensors()
        for name, (layer, lora) in self.layers.items():
            lora.load(layer, slot, name.rpartition(".")[0], adapter, tensors)
        self.resident[slot] = adapter.path

    def clear(self, slot: int) -> None:
        for _, lora in self.layers.values():
            lora.clear(slot)
        self.resident[slot] = None


def attach_lora(model: nn.Module, max_loras: int, max_rank: int) -> LoRASlots:
    """Give the model's linear layers ``max_loras`` adapter slots of rank up to ``max_rank``."""
    slots = LoRASlots(model, max_loras, max_rank)
    model.lora = slots  # type: ignore[assignment]
    return slots
