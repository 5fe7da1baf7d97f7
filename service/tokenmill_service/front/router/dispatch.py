"""Dispatch: admitting requests (bounded), sending each to a replica (``choice.py``: where its prompt's
prefix is probably cached and its LoRA adapter already runs, balanced against load, or the least
loaded), handing its
outputs to its stream, resuming the requests of a replica that died on another one (prompt + the
tokens already sent, same seed), and cancelling what callers abandon.

``Router`` is what the servicer talks to; the replicas themselves (processes, supervision,
restarts) are ``ReplicaPool``'s, which tells the router what happened through ``ReplicaListener``.
It lives on the server's asyncio loop and imports no torch.
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import time
import uuid
from collections.abc import Sequence

import structlog

from tokenmill_service.contract.config import Settings
from tokenmill_service.contract.messages import AdapterResult, AddRequest, Cancel, Embedded
from tokenmill_service.contract.request import GenerationRequest, RequestOutput
from tokenmill_service.front.metrics import Metrics
from tokenmill_service.front.router.adapters import Adapters
from tokenmill_service.front.router.choice import ReplicaChooser
from tokenmill_service.front.router.embeddings import EmbeddingCalls
from tokenmill_service.front.router.errors import Overloaded, Rejected, ShuttingDown, Unavailable
from tokenmill_service.front.router.replicas import Replica, ReplicaPool
from tokenmill_service.front.router.streams import InFlight, RequestStream

log = structlog.get_logger("tokenmill.router")


class Router:
    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        self.settings = settings
        self.pool = ReplicaPool(settings, metrics, self)
        self.num_workers = self.pool.num_workers
        # Set whenever a replica starts or stops serving, so health follows at once.
        self.state_changed = self.pool.state_changed
        self.requests: dict[str, InFlight] = {}
        # Requests whose replica died while no other could take them; admitted on the next Ready.
        self.parked: list[InFlight] = []
        self.draining = False
        self.chooser = ReplicaChooser(settings.routing, settings.block_size)
        # LoRA adapters: loaded and unloaded on every replica; a request's adapter checked on admission.
        self.adapters = Adapters(self.pool, self.adapter_users)
        # Embedding calls: each whole on one replica, between its engine's steps.
        self.embeddings = EmbeddingCalls(self.pool, lambda replica: len(replica.inflight))

    def adapter_users(self, name: str) -> int:
        """Requests in flight (running, queued or parked) with the LoRA adapter ``name``."""
        return sum(inflight.request.adapter == name for inflight in self.requests.values())

    @property
    def workers(self) -> list[Replica]:
        return self.pool.replicas

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self, timeout: float = 600.0) -> None:
        await self.pool.start(timeout)

    @property
    def ready(self) -> bool:
        return bool(self.pool.serving()) and not self.draining

    async def drain(self, seconds: float) -> None:
        """Refuse new work; give in-flight requests up to `seconds` to finish."""
        self.draining = True
        deadline = time.monotonic() + seconds
        while self.inflight_count() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        left = self.inflight_count()
        if left:
            log.warning("drain_timeout", abandoned=left)
            self.abandon()

    def abandon(self) -> None:
        """End every in-flight request with UNAVAILABLE."""
        for inflight in list(self.requests.values()):
            inflight.end(Unavailable("the server is shutting down"))

    async def stop(self) -> None:
        await self.pool.stop()

    def kill(self) -> None:
        """Stop at once: end every in-flight request and kill every worker process, without waiting."""
        self.draining = True
        self.abandon()
        self.pool.kill()

    # -- admission ---------------------------------------------------------------------------

    def inflight_count(self) -> int:
        return len(self.requests) + len(self.embeddings)

    def capacity(self) -> int:
        return len(self.pool.serving()) * self.settings.max_batch_size + self.settings.max_queue

    def submit(self, request: GenerationRequest) -> RequestStream:
        """Admit one request (or raise Unavailable / Overloaded at once) and stream its outputs."""
        return self.submit_group([request])[0]

    def submit_group(self, requests: Sequence[GenerationRequest]) -> list[RequestStream]:
        """Admit requests that belong together (the choices of one request, n > 1) on one replica, so
        they can share their prompt's KV blocks; all or none (Unavailable / Overloaded at once)."""
        if self.draining:
            raise ShuttingDown()
        for request in requests:
            self.adapters.check(request.adapter)
        if not self.pool.serving():
            raise Unavailable("no worker is ready to serve; retry shortly")
        if self.inflight_count() + len(requests) > self.capacity():
            raise Overloaded(
                f"the server is at capacity ({self.capacity()} requests in flight, "
                f"queue size {self.settings.max_queue}); retry later"
            )
        worker = self._pick(requests[0].prompt_ids, requests[0].adapter)
        assert worker is not None
        streams = []
        for request in requests:
            # The engine's id is ours, unique; the caller's request_id stays in the servicer.
            request.request_id = uuid.uuid4().hex
            if request.sampling.seed is None:
                # Fixed now, so that a resumed request continues the same random stream.
                request.sampling.seed = secrets.randbits(63)
            stream = RequestStream(self._drop)
            inflight = InFlight(request, stream)
            stream.inflight = inflight
            self.requests[request.request_id] = inflight
            self._dispatch(inflight, worker)
            streams.append(stream)
        log.debug(
            "request_dispatched", worker_id=worker.worker_id, load=len(worker.inflight), adapter=requests[0].adapter
        )
        return streams

    async def embed(self, inputs: Sequence[Sequence[int]], dimensions: int) -> list[bytes]:
        """Each input's vector (little-endian float32 bytes), or Unavailable / Overloaded / Rejected."""
        if self.draining:
            raise ShuttingDown()
        if self.inflight_count() + 1 > self.capacity():
            raise Overloaded(f"the server is at capacity ({self.capacity()} requests in flight); retry later")
        return await self.embeddings.embed(inputs, dimensions)

    def _pick(self, prompt_ids: Sequence[int], adapter: str) -> Replica | None:
        candidates = {w.worker_id: w for w in self.pool.serving()}
        loads = {i: len(w.inflight) for i, w in candidates.items()}
        users = {}
        if adapter:
            users = {i: sum(f.request.adapter == adapter for f in w.inflight.values()) for i, w in candidates.items()}
        chosen = self.chooser.choose(prompt_ids, loads, self.adapters.key(adapter), users)
        return None if chosen is None else candidates[chosen]

    @staticmethod
    def _tokens(inflight: InFlight) -> list[int]:
        """What a (resumed) request's replica will prefill: its prompt and the tokens already sent."""
        return [*inflight.request.prompt_ids, *inflight.sent_ids]

    def _dispatch(self, inflight: InFlight, replica: Replica) -> None:
        request = inflight.request
        if inflight.delivered:
            # The engine prefills prompt + sent tokens and primes its detokenizer with them, emitting nothing twice.
            request = dataclasses.replace(request, resume_ids=list(inflight.sent_ids), prompt_logprobs=False)
        inflight.replica = replica
        replica.inflight[request.request_id] = inflight
        self.pool.send(replica, AddRequest(request))

    def _drop(self, inflight: InFlight) -> None:
        """Forget a request (finished, failed or abandoned); cancel it in its replica if it still runs it."""
        request_id = inflight.request.request_id
        self.requests.pop(request_id, None)
        if inflight in self.parked:
            self.parked.remove(inflight)
        replica, inflight.replica = inflight.replica, None
        if replica is not None and replica.inflight.pop(request_id, None) is not None and replica.alive:
            self.pool.send(replica, Cancel(request_id))

    # -- what the replicas report (ReplicaListener) --------------------------------------------

    def on_outputs(self, replica: Replica, outputs: Sequence[RequestOutput]) -> None:
        for out in outputs:
            inflight = replica.inflight.get(out.request_id)
            if inflight is None:
                continue  # cancelled meanwhile
            inflight.deliver(out)
            if out.finished:
                del replica.inflight[out.request_id]
                self.requests.pop(out.request_id, None)

    def on_rejected(self, replica: Replica, request_id: str, message: str) -> None:
        inflight = replica.inflight.pop(request_id, None)
        self.requests.pop(request_id, None)
        if inflight is not None:
            inflight.end(Rejected(message))

    def on_adapter_result(self, replica: Replica, result: AdapterResult) -> None:
        self.adapters.on_result(replica, result)

    def on_embedded(self, replica: Replica, answer: Embedded) -> None:
        self.embeddings.on_embedded(replica, answer)

    def on_replica_lost(self, replica: Replica, reason: str) -> None:
        self.embeddings.on_replica_lost(replica, reason)

    def on_ready(self, replica: Replica) -> None:
        # A (re)started replica's cache is empty: so is what the router thinks it holds.
        info = replica.info
        self.chooser.replica_started(replica.worker_id, info.kv_blocks_total if info is not None else 0)
        self.adapters.on_ready(replica)
        parked, self.parked = self.parked, []
        for inflight in parked:
            target = self._pick(self._tokens(inflight), inflight.request.adapter)
            if target is None:
                self.parked.append(inflight)
            else:
                self._dispatch(inflight, target)

    def on_lost(self, lost: list[InFlight], reason: str) -> None:
        for inflight in lost:
            if self.pool.stopping:
                inflight.end(Unavailable("the server is shutting down"))
            else:
                self._resume(inflight, reason)

    def _resume(self, inflight: InFlight, reason: str) -> None:
        """Re-admit a request whose replica died: prompt + the tokens already sent, same seed."""
        limit = self.settings.max_resumptions
        if inflight.resumptions >= limit:
            self._drop(inflight)
            moved = f"it was already resumed {inflight.resumptions} times" if limit else "resumption is off"
            inflight.end(Unavailable(f"{reason}; {moved} (--max-resumptions {limit}); retry the request"))
            return
        inflight.resumptions += 1
        inflight.replica = None
        target = self._pick(self._tokens(inflight), inflight.request.adapter)
        log.info(
            "request_resumed",
            request_id=inflight.request.request_id,
            tokens_sent=len(inflight.sent_ids),
            resumptions=inflight.resumptions,
            worker_id=target.worker_id if target is not None else None,
        )
        if target is None:
            self.parked.append(inflight)
        else:
            self._dispatch(inflight, target)
