"""Which replica runs a request: the least loaded (``--routing least-load``), or the one best placed
by the endpoint picker's kind of score (``--routing prefix``, the default):

    score = hit − load / max_batch_size

``hit`` is the share of the prompt's full blocks the replica probably holds (``PrefixIndex``),
``load`` the requests it runs or queues. A replica holding the whole prefix keeps winning until its
running batch is full; past that, the queue it would join outweighs the prefill it would save.
Equal scores go to the less loaded replica, then in turn, so unrelated prompts spread.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenmill_service.engine.block_hash import full_block_hashes
from tokenmill_service.router.prefix_index import PrefixIndex

ROUTINGS = ("prefix", "least-load")


class ReplicaChooser:
    def __init__(self, routing: str, block_size: int, max_batch_size: int) -> None:
        if routing not in ROUTINGS:
            raise ValueError(f"unknown routing {routing!r}: {' or '.join(ROUTINGS)}")
        self.routing = routing
        self.block_size = block_size
        self.max_batch_size = max(1, max_batch_size)
        self.index = PrefixIndex()
        self._turn = 0

    def replica_started(self, replica: int, kv_blocks: int) -> None:
        self.index.reset(replica, kv_blocks)

    def choose(self, prompt_ids: Sequence[int], loads: dict[int, int]) -> int | None:
        """The replica (of `loads`: id -> requests in flight) to run `prompt_ids` on; records the choice."""
        if not loads:
            return None
        ids = sorted(loads)
        if self.routing == "least-load":
            return min(ids, key=lambda r: loads[r])
        hashes = full_block_hashes(prompt_ids, self.block_size)
        scores = {r: self._score(r, hashes, loads[r]) for r in ids}
        best = max(scores.values())
        tied = [r for r in ids if scores[r] == best]
        least = min(loads[r] for r in tied)
        tied = [r for r in tied if loads[r] == least]
        self._turn += 1
        chosen = tied[self._turn % len(tied)]
        self.index.record(chosen, hashes)
        return chosen

    def _score(self, replica: int, hashes: list[int], load: int) -> float:
        hit = self.index.matched(replica, hashes) / len(hashes) if hashes else 0.0
        return hit - load / self.max_batch_size
