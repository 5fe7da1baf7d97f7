"""Resident adapter slots on a model's linear layers, and the per-step batch that says who uses which.

``attach_lora(model, max_loras, max_rank, dtype)`` gives every linear layer of the decoder (not the
output head) a ``LoRALayer``: its adapters' A and B stacked in ``max_loras`` slots of rank ``max_rank``
(no padding), in ``dtype`` (bfloat16 by default, float32 under ``--dtype float32``: the plan's
``lora_dtype``), for this rank's shard as the layer shards its weight (a column-parallel layer keeps its
columns of B.T, a row-parallel one its columns of A; packed q/k/v and gate/up keep one block of rank per
projection, each against its own output columns). Each slot's rank per projection is recorded, and
only those rows are read: an adapter of rank 8 in slots of rank 64 costs the bytes of rank 8.
The base's weights and its quantization method are untouched: the layer adds the delta to what
its method returns (before the all-reduce of a row-parallel layer, whose partial deltas sum there).

``LoRASlots.load(slot, adapter)`` writes an adapter into a slot on this rank; the runner sets the
step's ``LoRABatch`` (which tokens use which slot) once, and every layer reads it. On a CPU the layer
adds its deltas in place with worker/kernels/cpu/lora.py (what the native decoder stack calls too); elsewhere
the grouped product is sgmv.py's, or under ``--backend triton`` (the model's plan) the Triton kernels
of worker/kernels/triton/lora.py, with the same signature.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tokenmill_service.worker.kernels import LoRADelta, LoRAStack, ops_class
from tokenmill_service.worker.kernels import lora as native
from tokenmill_service.worker.layers.lora.adapter import BaseDims, LoRAAdapter, read_adapter
from tokenmill_service.worker.layers.lora.sgmv import lora_delta, native_reads, part_table


@dataclass(slots=True)
class LoRABatch:
    """The step's tokens by adapter slot: (slot, token rows) for each slot in use; empty: base only."""

    groups: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    _rows: native.Rows | None = None

    def set(self, token_slots: list[int], device: torch.device) -> None:
        rows: dict[int, list[int]] = {}
        for t, slot in enumerate(token_slots):
            if slot >= 0:
                rows.setdefault(slot, []).append(t)
        self.groups = [(s, torch.tensor(r, dtype=torch.long, device=device)) for s, r in sorted(rows.items())]
        self._rows = None

    def rows(self) -> native.Rows:
        """The groups as the native kernels take them (made once a step)."""
        if self._rows is None:
            self._rows = native.Rows.of(self.groups)
        return self._rows


class LoRALayer:
    """One linear layer's adapter slots, ``stack`` (``LoRAStack``): ``a`` [slots, P, R, in] for its P projections
    (3 for q/k/v, 2 for gate/up, else 1) and ``bt`` [slots, R, out] (B transposed, the scale folded in): each
    output column's B against its own projection's block of A (``parts``: each projection's output columns, as
    (local start, count)), so no zeros of a block-diagonal B are stored, read or multiplied. ``ranks``
    [slots, P]: the rows of each block the slot's adapter fills (0: not targeted)."""

    def __init__(
        self,
        layer: Any,
        projections: list[tuple[str, str | int | None]],
        slots: int,
        rank: int,
        batch: LoRABatch,
        delta: LoRADelta = lora_delta,
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        self.projections = projections  # (checkpoint leaf, the layer's shard id) per block of rank
        self.rank = rank
        self.batch = batch
        self.delta = delta
        pieces = [layer._pieces(shard) for _, shard in projections]
        assert all(len(p) == 1 for p in pieces), "a projection's rows are one range of the layer's"
        # Plain tensors, not buffers: the model's state (and its checkpoint loading) stays the base's.
        self.stack = LoRAStack(
            a=torch.zeros(slots, len(projections), rank, layer.in_features, dtype=dtype),
            bt=torch.zeros(slots, rank, layer.out_features, dtype=dtype),
            ranks=torch.zeros(slots, len(projections), dtype=torch.int64),
            parts=[(local, count) for ((_, count, local),) in pieces],
        )
        self.part_rows = part_table(self.stack.parts).to(self.stack.ranks.device)
        # The in-place native kernel (the decoder stack's): with sgmv's product, on a CPU, where it is built.
        a = self.stack.a
        self.native = delta is lora_delta and native_reads(torch.empty(0, layer.in_features, device=a.device), a)

    @property
    def bytes_per_slot(self) -> int:
        """What one slot holds on this layer (at the slots' rank)."""
        a, bt = self.stack.a, self.stack.bt
        return (a[0].numel() + bt[0].numel()) * a.element_size()

    def clear(self, slot: int) -> None:
        # No kernel reads past a slot's ranks, so the weights need no zeroing (zeroing every layer's slot
        # took most of a slot write).
        self.stack.ranks[slot].zero_()

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
        stack, r = self.stack, adapter.rank
        for i, (leaf, shard) in enumerate(self.projections):
            pair = tensors.get(f"{prefix}.{leaf}")
            if pair is None:
                continue
            a, b = pair
            stack.a[slot, i, :r] = layer._columns(a).to(stack.a.dtype)
            for start, count, local in layer._pieces(shard):
                # The scale is folded into B in float32, then rounded once to the slots' dtype.
                stack.bt[slot, :r, local : local + count] = (b[start : start + count].float() * adapter.scale).t()
            stack.ranks[slot, i] = r

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (the base's product of ``x``) with each adapter token's delta added."""
        if self.native:
            out = y if y.dtype == torch.float32 and y.is_contiguous() else y.float().contiguous()
            stack = self.stack
            native.lora_add(
                x.float().contiguous(), out, stack.a, stack.bt, stack.ranks, self.part_rows, self.batch.rows()
            )
            return out if out is y else out.to(y.dtype)
        for rows, delta in self.delta(x, self.stack, self.batch.groups):
            y = y.index_add(0, rows, delta.to(y.dtype))
        return y


class LoRASlots:
    """Every adapter-capable layer of a model and the step's batch they share."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, dtype: torch.dtype = torch.bfloat16) -> None:
        from tokenmill_service.worker.layers.linear import LinearBase

        self.max_loras, self.max_rank, self.dtype = max_loras, max_rank, dtype
        self.config: BaseDims = model.config  # type: ignore[assignment]
        self.batch = LoRABatch()
        sources: dict[str, list[tuple[str, str | int | None]]] = {}
        for leaf, (packed, shard) in getattr(type(model), "packed_modules", {}).items():
            sources.setdefault(packed, []).append((leaf, shard))
        plan = getattr(model, "plan", None)
        # The ops backend's grouped product where it has its own (Triton's), else sgmv.py's.
        delta = (ops_class(plan.ops.value).lora_delta() if plan is not None else None) or lora_delta
        self.layers: dict[str, tuple[Any, LoRALayer]] = {}  # parent prefix -> (linear layer, its slots)
        for name, module in model.named_modules():
            if isinstance(module, LinearBase) and name.startswith("model.layers."):
                leaf = name.rpartition(".")[2]
                lora = LoRALayer(
                    module, sources.get(leaf, [(leaf, None)]), max_loras, max_rank, self.batch, delta, dtype
                )
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

    @property
    def bytes_per_slot(self) -> int:
        """What one adapter slot holds over every layer on this rank."""
        return sum(lora.bytes_per_slot for _, lora in self.layers.values())


def attach_lora(model: nn.Module, max_loras: int, max_rank: int, dtype: torch.dtype = torch.bfloat16) -> LoRASlots:
    """Give the model's linear layers ``max_loras`` adapter slots of rank up to ``max_rank``, in ``dtype``."""
    slots = LoRASlots(model, max_loras, max_rank, dtype)
    model.lora = slots  # type: ignore[assignment]
    return slots
