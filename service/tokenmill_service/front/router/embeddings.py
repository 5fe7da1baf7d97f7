"""Embedding calls across the replicas: each call goes whole to the least loaded serving replica, as one
``Embed`` command, and waits for its ``Embedded`` answer. A replica that dies with calls unanswered ends
them with Unavailable (an embedding has nothing to resume: the caller retries it whole)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tokenmill_service.contract.messages import Embed, Embedded
from tokenmill_service.front.router.errors import Rejected, Unavailable
from tokenmill_service.front.router.replicas import Replica, ReplicaPool


@dataclass(slots=True)
class _Call:
    replica: Replica
    answer: asyncio.Future[Embedded]


class EmbeddingCalls:
    def __init__(self, pool: ReplicaPool, load: Callable[[Replica], int]) -> None:
        self.pool = pool
        self.load = load  # a replica's requests in flight (generations), to pick the least loaded
        self._calls: dict[str, _Call] = {}

    def __len__(self) -> int:
        return len(self._calls)

    async def embed(self, inputs: Sequence[Sequence[int]], dimensions: int) -> list[bytes]:
        """Each input's vector (little-endian float32 bytes), from one replica."""
        replicas = self.pool.serving()
        if not replicas:
            raise Unavailable("no worker is ready to serve; retry shortly")
        busy = {id(w): sum(c.replica is w for c in self._calls.values()) for w in replicas}
        replica = min(replicas, key=lambda w: (self.load(w) + busy[id(w)], w.worker_id))
        request_id = uuid.uuid4().hex
        call = _Call(replica, asyncio.get_running_loop().create_future())
        self._calls[request_id] = call
        try:
            self.pool.send(replica, Embed(request_id, [list(ids) for ids in inputs], dimensions))
            answer = await call.answer
        finally:
            self._calls.pop(request_id, None)
        if answer.error:
            raise Rejected(answer.error)
        return answer.vectors

    def on_embedded(self, replica: Replica, answer: Embedded) -> None:
        call = self._calls.get(answer.request_id)
        if call is not None and not call.answer.done():
            call.answer.set_result(answer)

    def on_replica_lost(self, replica: Replica, reason: str) -> None:
        for call in self._calls.values():
            if call.replica is replica and not call.answer.done():
                call.answer.set_exception(Unavailable(f"{reason}; retry the request"))
