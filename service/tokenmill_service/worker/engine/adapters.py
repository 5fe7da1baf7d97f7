"""Which LoRA adapters a worker serves, and which of them sit in the model's slots.

Adapters are registered by name (``--lora-modules``, or loaded at run time); at most ``max_loras``
of them are resident at once. The scheduler asks ``acquire`` before admitting a sequence: its
adapter gets a slot, evicting the least recently used one that no running sequence holds, or the
sequence waits. What moves into a slot is handed to the runner (``take_loads``), which writes it on
every rank before the step. Torch-free: adapters are read and checked by ``worker/layers/lora/adapter.py``.
"""

from __future__ import annotations

from itertools import count

from tokenmill_service.worker.layers.lora.adapter import AdapterError, BaseDims, LoRAAdapter, read_adapter


class AdapterManager:
    def __init__(self, max_loras: int, max_rank: int, config: BaseDims) -> None:
        self.max_loras, self.max_rank, self.config = max_loras, max_rank, config
        self.registered: dict[str, LoRAAdapter] = {}
        self.slots: list[str | None] = [None] * max_loras
        self._clock = count()
        self._last_used: dict[str, int] = {}
        self._loads: list[tuple[int, str, str]] = []
        # Each registration's number: what the prefix cache keys blocks by (a name loaded again, maybe
        # from other files, never finds the blocks of its earlier self).
        self._registrations = count(1)
        self.keys: dict[str, str] = {}

    def register(self, name: str, path: str) -> LoRAAdapter:
        """Check the adapter at ``path`` against the base and serve it as ``name`` (AdapterError: refused)."""
        if not name:
            raise AdapterError("an adapter needs a name")
        if name in self.registered:
            raise AdapterError(f"an adapter named {name!r} is already loaded (from {self.registered[name].path})")
        adapter = read_adapter(name, path, self.config, self.max_rank)
        self.registered[name] = adapter
        self.keys[name] = f"{name}#{next(self._registrations)}"
        return adapter

    def unregister(self, name: str) -> None:
        """Stop serving ``name`` (the caller has checked that no request uses it)."""
        del self.registered[name]
        self.keys.pop(name, None)
        if name in self.slots:
            self.slots[self.slots.index(name)] = None  # the stale weights stay until a new adapter takes it

    def acquire(self, name: str, pinned: set[str]) -> bool:
        """Make ``name`` resident; False when every slot holds an adapter of a running sequence."""
        self._last_used[name] = next(self._clock)
        if name in self.slots:
            return True
        free = [i for i, held in enumerate(self.slots) if held is None]
        if not free:
            evictable = [i for i, held in enumerate(self.slots) if held not in pinned]
            if not evictable:
                return False
            free = [min(evictable, key=lambda i: self._last_used.get(self.slots[i] or "", -1))]
        slot = free[0]
        self.slots[slot] = name
        self._loads.append((slot, name, self.registered[name].path))
        return True

    def slot_of(self, name: str) -> int:
        return self.slots.index(name) if name else -1

    def take_loads(self) -> list[tuple[int, str, str]]:
        """The (slot, name, path) written since the last call, for the runner to carry out."""
        loads, self._loads = self._loads, []
        return loads


__all__ = ["AdapterError", "AdapterManager"]
