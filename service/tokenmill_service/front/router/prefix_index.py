"""Where each prompt prefix is probably cached: the router's approximate index of the KV blocks it
sent to each replica, for prefix-aware routing (``--routing prefix``).

The router does not see the workers' caches. It remembers, per replica, the chained hashes of the
full prompt blocks it sent there (``contract/block_hash.py``, the block manager's own hashes), the
most recently used first to survive: at most as many blocks as the replica's KV cache holds, the
older ones taken for evicted. A replica that restarts starts with an empty cache, and so does its
entry here. This is the endpoint picker's "estimated" prefix cache, kept inside one server.
"""

from __future__ import annotations

from collections import OrderedDict

# Blocks remembered for a replica whose pool size is not known yet.
DEFAULT_CAPACITY = 4096


class PrefixIndex:
    def __init__(self) -> None:
        self._blocks: dict[int, OrderedDict[int, None]] = {}
        self._capacity: dict[int, int] = {}

    def reset(self, replica: int, capacity: int) -> None:
        """Forget what `replica` held (it started, or restarted) and bound it to `capacity` blocks."""
        self._blocks[replica] = OrderedDict()
        self._capacity[replica] = max(1, capacity)

    def matched(self, replica: int, hashes: list[int]) -> int:
        """How many leading blocks of `hashes` `replica` probably holds."""
        held = self._blocks.get(replica)
        if not held:
            return 0
        count = 0
        for h in hashes:
            if h not in held:
                break
            count += 1
        return count

    def record(self, replica: int, hashes: list[int]) -> None:
        """`replica` was sent these blocks: they become its most recently used, older ones go past its capacity."""
        held = self._blocks.setdefault(replica, OrderedDict())
        for h in hashes:
            held[h] = None
            held.move_to_end(h)
        capacity = self._capacity.get(replica, DEFAULT_CAPACITY)
        while len(held) > capacity:
            held.popitem(last=False)

    def size(self, replica: int) -> int:
        return len(self._blocks.get(replica, ()))
