"""Which layers share a block table: the KV cache's groups, for models that mix windowed and global layers.

A sliding-window (local) layer never reads a key more than its window behind its query, so its blocks
behind the window can go; a global layer needs them all. So the layers are split into groups whose
members are all local or all global: every group has its own block table per sequence, all drawing
block ids from one pool (worker/engine/block_manager.py), and layer ``j`` of every group keeps its keys and
values in the cache's storage tensor ``j`` (model_runner.py allocates ``group_size`` of them, not one
per layer). A local group's table frees the blocks behind the window as an every-layer-windowed model's
does; a global group's keeps them all. With ``L`` local and ``G`` global layers the groups hold
``min(L, G)`` layers each, the last of a kind fewer where that does not divide (its block ids leave
the other storage tensors unused): few groups, since every group costs a block table per sequence in
each step's metadata. Gemma 2's alternate layers (L, G, L, G) make one local group {0, 2} and one
global group {1, 3}; Gemma 3's six layers (five local to one global), six groups of one layer;
Gemma-3-4B's 34 (29 local, 5 global), six local groups of five layers (the last of four) and one global.

Every layer windowed, or none, is the one-group case (every layer in one group, as before groups).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KVCacheGroups:
    # Per group: its layers (in order; the i-th uses storage tensor i), and the window whose blocks
    # behind it the group frees (None: it keeps every block).
    layers: tuple[tuple[int, ...], ...]
    windows: tuple[int | None, ...]
    reason: str = ""  # why these groups, in a few words

    @property
    def num_groups(self) -> int:
        return len(self.layers)

    @property
    def group_size(self) -> int:
        """Layers per group (the most; a group of fewer leaves the last tensors unused): the storage
        tensors a block id stands for."""
        return max(len(layers) for layers in self.layers)

    @property
    def num_layers(self) -> int:
        return sum(len(layers) for layers in self.layers)

    def placement(self) -> list[tuple[int, int]]:
        """Per layer: (its group, its storage tensor)."""
        where = [(0, 0)] * self.num_layers
        for g, layers in enumerate(self.layers):
            for j, layer in enumerate(layers):
                where[layer] = (g, j)
        return where

    def describe(self) -> str:
        """The groups, and why, as ``value (reason)`` (the log, and GetModelInfo's load plan)."""
        local = sum(w is not None for w in self.windows)
        if self.num_groups == 1:
            value = "one block table for every layer"
        else:
            value = (
                f"{self.num_groups} block tables of {self.group_size} layer(s) at most: {local} windowed "
                f"(blocks behind the window freed), {self.num_groups - local} global (every block kept)"
            )
        return f"{value} ({self.reason})" if self.reason else value


def one_group(num_layers: int, window: int | None = None, reason: str = "") -> KVCacheGroups:
    """Every layer in one group (``window``: every layer's widest, None: some layer sees the whole context)."""
    return KVCacheGroups((tuple(range(num_layers)),), (window,), reason)


def plan_kv_cache_groups(windows: list[int | None], keep_every_block: bool | str = False) -> KVCacheGroups:
    """The groups for layers with these sliding windows (None: global). ``keep_every_block`` (or why, as a
    string): one group that frees nothing."""
    if keep_every_block:
        return one_group(len(windows), reason=keep_every_block if isinstance(keep_every_block, str) else "")
    local = [i for i, w in enumerate(windows) if w is not None]
    global_ = [i for i, w in enumerate(windows) if w is None]
    if not local:
        return one_group(len(windows), reason="no layer has a sliding window: every block kept")
    widest = max(w for w in windows if w is not None)
    if not global_:
        return one_group(len(windows), widest, f"every layer attends within a {widest}-token window")
    size = min(len(local), len(global_))
    reason = f"{len(local)} windowed and {len(global_)} global layers: groups of {size}"
    groups = [
        (tuple(ls[k : k + size]), w) for ls, w in ((local, widest), (global_, None)) for k in range(0, len(ls), size)
    ]
    groups.sort(key=lambda g: g[0][0])  # by first layer
    return KVCacheGroups(tuple(g[0] for g in groups), tuple(g[1] for g in groups), reason)
