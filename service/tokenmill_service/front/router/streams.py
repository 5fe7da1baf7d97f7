"""One admitted request as the router keeps it (``InFlight``: enough to resume it elsewhere) and
as its caller reads it (``RequestStream``: outputs in order, across resumptions)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenmill_service.contract.request import GenerationRequest, RequestOutput
from tokenmill_service.front.router.errors import DeadlineExceeded

if TYPE_CHECKING:
    from tokenmill_service.front.router.replicas import Replica


@dataclass(eq=False)
class InFlight:
    """What the router keeps of an admitted request so it can resume it on another replica."""

    request: GenerationRequest  # as admitted: its seed is fixed, so a resumed draw is the same draw
    stream: RequestStream
    replica: Replica | None = None  # None while parked, waiting for a replica
    sent_ids: list[int] = field(default_factory=list)  # every token id handed to the caller
    delivered: bool = False  # the first output (with any prompt logprobs) has been handed over
    resumptions: int = 0

    def deliver(self, output: RequestOutput) -> None:
        self.sent_ids.extend(t.id for t in output.tokens)
        self.delivered = True
        self.stream.queue.put_nowait(output)

    def end(self, error: Exception) -> None:
        self.stream.queue.put_nowait(error)


class RequestStream:
    """One admitted request's outputs, in order, across resumptions; closing it early cancels it."""

    inflight: InFlight

    def __init__(self, drop: Callable[[InFlight], None]) -> None:
        self._drop = drop
        self.queue: asyncio.Queue[RequestOutput | Exception] = asyncio.Queue()
        self.done = False
        self._timer: asyncio.TimerHandle | None = None

    def expire_after(self, seconds: float) -> None:
        """End the stream with DeadlineExceeded unless it finishes within `seconds`."""
        error = DeadlineExceeded("the deadline passed before generation ended")
        self._timer = asyncio.get_running_loop().call_later(max(0.0, seconds), self.queue.put_nowait, error)

    @property
    def worker_id(self) -> int | None:
        replica = self.inflight.replica
        return replica.worker_id if replica is not None else None

    @property
    def resumptions(self) -> int:
        return self.inflight.resumptions

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.done:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, Exception):
            self.done = True
            raise item
        self.done = item.finished
        return item

    def close(self) -> None:
        """Stop the request if a replica still runs it (the caller left, its deadline passed, or the
        server drained); the router forgets a request once it finished or failed for good."""
        if self._timer is not None:
            self._timer.cancel()
        self.done = True
        self._drop(self.inflight)
