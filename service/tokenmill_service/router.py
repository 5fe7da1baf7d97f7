"""The router: spawns and supervises the worker processes, sends each request to the least
loaded replica, streams its outputs back, and cancels what callers abandon.

It lives on the server's asyncio loop. Worker pipes and process sentinels are watched with
`loop.add_reader`, so there are no threads; commands for a worker are gathered and sent once
per loop turn.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import socket
import time
import uuid
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import structlog

from tokenmill_service.config import Settings
from tokenmill_service.engine.config import EngineConfig
from tokenmill_service.engine.llm_engine import EngineStats
from tokenmill_service.engine.request import GenerationRequest, RequestOutput
from tokenmill_service.metrics import Metrics
from tokenmill_service.worker import WorkerInfo, WorkerSpec, worker_main

log = structlog.get_logger("tokenmill.router")


class RouterError(Exception):
    """Base of the errors a caller of `Router.generate` sees; each maps to a gRPC status."""


class Unavailable(RouterError):
    pass


class Overloaded(RouterError):
    pass


class DeadlineExceeded(RouterError):
    pass


class Rejected(RouterError):
    """The worker's engine refused the request (a limit the servicer could not check)."""


class WorkerStartError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(eq=False)
class WorkerHandle:
    worker_id: int
    process: BaseProcess
    conn: Connection
    info: WorkerInfo | None = None
    alive: bool = True
    stats: EngineStats | None = None
    restarts: int = 0
    # engine request id -> the queue its outputs go to
    inflight: dict[str, asyncio.Queue[RequestOutput | Exception]] = field(default_factory=dict)
    pending: list[tuple[Any, ...]] = field(default_factory=list)
    ready: asyncio.Future[WorkerInfo] | None = None

    @property
    def serving(self) -> bool:
        return self.alive and self.info is not None


class Router:
    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.num_workers = settings.resolved_workers()
        self.workers: list[WorkerHandle] = []
        self.draining = False
        self.stopping = False
        self._ctx = mp.get_context("spawn")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._restart_tasks: set[asyncio.Task[None]] = set()

    # -- lifecycle ---------------------------------------------------------------------------

    def _spec(self, worker_id: int) -> WorkerSpec:
        s = self.settings
        cores = os.cpu_count() or 1
        threads = s.threads or (max(1, cores // self.num_workers) if s.device == "cpu" else 1)
        engine = EngineConfig(
            max_batch_size=s.max_batch_size,
            max_batch_tokens=max(s.max_batch_tokens, s.max_batch_size),
            block_size=s.block_size,
            kv_cache_memory=s.kv_cache_bytes,
        )
        return WorkerSpec(
            worker_id=worker_id,
            rank=0,
            device_index=worker_id * s.tensor_parallel,
            world_size=s.tensor_parallel,
            master_addr="127.0.0.1",
            master_port=(s.master_port + worker_id) if s.master_port else free_port(),
            model=s.model,
            device=s.device,
            dtype=s.dtype,
            engine=engine,
            threads=threads,
            log_format=s.resolved_log_format(),
            log_level=s.log_level,
        )

    def _spawn(self, worker_id: int, restarts: int = 0) -> WorkerHandle:
        assert self._loop is not None
        parent, child = self._ctx.Pipe(duplex=True)
        spec = self._spec(worker_id)
        proc = self._ctx.Process(target=worker_main, args=(spec, child), name=f"tokenmill-worker-{worker_id}")
        proc.daemon = True
        proc.start()
        child.close()
        handle = WorkerHandle(worker_id, proc, parent, restarts=restarts)
        handle.ready = self._loop.create_future()
        self._loop.add_reader(parent.fileno(), self._on_readable, handle)
        self._loop.add_reader(proc.sentinel, self._on_exit, handle)
        log.info("worker_spawned", worker_id=worker_id, pid=proc.pid, master_port=spec.master_port)
        return handle

    async def start(self, timeout: float = 600.0) -> None:
        """Spawn every worker and wait until each has loaded the model and run a warm-up step."""
        self._loop = asyncio.get_running_loop()
        self.workers = [self._spawn(i) for i in range(self.num_workers)]
        futures = [w.ready for w in self.workers if w.ready is not None]
        await asyncio.wait_for(asyncio.gather(*futures), timeout)

    @property
    def ready(self) -> bool:
        return bool(self.workers) and any(w.serving for w in self.workers) and not self.draining

    async def drain(self, seconds: float) -> None:
        """Refuse new work; give in-flight requests up to `seconds` to finish."""
        self.draining = True
        deadline = time.monotonic() + seconds
        while self.inflight_count() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        left = self.inflight_count()
        if left:
            log.warning("drain_timeout", abandoned=left)
            for w in self.workers:
                for q in w.inflight.values():
                    q.put_nowait(Unavailable("the server is shutting down"))

    async def stop(self) -> None:
        self.stopping = True
        for task in self._restart_tasks:
            task.cancel()
        for w in self.workers:
            if w.alive:
                w.pending.append(("shutdown",))
                self._flush(w)
        deadline = time.monotonic() + 10
        for w in self.workers:
            while w.process.is_alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if w.process.is_alive():
                log.warning("worker_killed", worker_id=w.worker_id)
                w.process.kill()
            self._forget(w)

    # -- messages from workers ----------------------------------------------------------------

    def _forget(self, w: WorkerHandle) -> None:
        assert self._loop is not None
        if w.alive:
            w.alive = False
            self._loop.remove_reader(w.conn.fileno())
            self._loop.remove_reader(w.process.sentinel)
            w.conn.close()

    def _on_readable(self, w: WorkerHandle) -> None:
        try:
            while w.alive and w.conn.poll():
                self._handle(w, w.conn.recv())
        except (EOFError, OSError):
            self._on_exit(w)

    def _handle(self, w: WorkerHandle, msg: tuple[Any, ...]) -> None:
        kind = msg[0]
        if kind == "step":
            outputs: list[RequestOutput] = msg[1]
            w.stats = msg[2]
            for out in outputs:
                queue = w.inflight.get(out.request_id)
                if queue is None:
                    continue  # cancelled meanwhile
                queue.put_nowait(out)
                if out.finished:
                    del w.inflight[out.request_id]
        elif kind == "stats":
            w.stats = msg[1]
        elif kind == "rejected":
            queue = w.inflight.pop(msg[1], None)
            if queue is not None:
                queue.put_nowait(Rejected(msg[2]))
        elif kind == "ready":
            w.info = msg[1]
            log.info("worker_ready", worker_id=w.worker_id, pid=w.info.pid if w.info else None)
            if w.ready is not None and not w.ready.done():
                w.ready.set_result(msg[1])
        elif kind == "failed":
            log.error("worker_failed_to_start", worker_id=w.worker_id, error=msg[1])
            if w.ready is not None and not w.ready.done():
                w.ready.set_exception(WorkerStartError(f"worker {w.worker_id} failed to start: {msg[1]}"))

    def _on_exit(self, w: WorkerHandle) -> None:
        if not w.alive:
            return
        # Read whatever the worker sent before it went (its last outputs or its start error).
        try:
            while w.conn.poll():
                self._handle(w, w.conn.recv())
        except (EOFError, OSError):
            pass
        w.process.join(timeout=1)
        code = w.process.exitcode
        self._forget(w)
        lost = len(w.inflight)
        for queue in w.inflight.values():
            queue.put_nowait(Unavailable(f"worker {w.worker_id} stopped (exit code {code}); retry the request"))
        w.inflight.clear()
        if w.ready is not None and not w.ready.done():
            w.ready.set_exception(WorkerStartError(f"worker {w.worker_id} exited with code {code} while starting"))
            return
        if self.stopping:
            return
        log.error("worker_died", worker_id=w.worker_id, exit_code=code, failed_requests=lost)
        self.metrics.worker_restarts.inc()
        task = asyncio.ensure_future(self._restart(w))
        self._restart_tasks.add(task)
        task.add_done_callback(self._restart_tasks.discard)

    async def _restart(self, dead: WorkerHandle) -> None:
        delay = 1.0
        while not self.stopping:
            await asyncio.sleep(delay)
            handle = self._spawn(dead.worker_id, restarts=dead.restarts + 1)
            self.workers[dead.worker_id] = handle
            try:
                assert handle.ready is not None
                await asyncio.wait_for(asyncio.shield(handle.ready), 600)
                log.info("worker_restarted", worker_id=dead.worker_id, restarts=handle.restarts)
                return
            except (WorkerStartError, asyncio.TimeoutError) as exc:
                log.error("worker_restart_failed", worker_id=dead.worker_id, error=str(exc))
                self._forget(handle)
                if handle.process.is_alive():
                    handle.process.kill()
                dead = handle
                delay = min(delay * 2, 30.0)

    # -- requests ------------------------------------------------------------------------------

    def _send(self, w: WorkerHandle, cmd: tuple[Any, ...]) -> None:
        assert self._loop is not None
        if not w.pending:
            self._loop.call_soon(self._flush, w)
        w.pending.append(cmd)

    def _flush(self, w: WorkerHandle) -> None:
        cmds, w.pending = w.pending, []
        if cmds and w.alive:
            try:
                w.conn.send(cmds)
            except (BrokenPipeError, OSError):
                self._on_exit(w)

    def inflight_count(self) -> int:
        return sum(len(w.inflight) for w in self.workers)

    def capacity(self) -> int:
        serving = sum(1 for w in self.workers if w.serving)
        return serving * self.settings.max_batch_size + self.settings.max_queue

    def submit(self, request: GenerationRequest) -> RequestStream:
        """Admit one request (or raise Unavailable / Overloaded at once) and stream its outputs."""
        if self.draining:
            raise Unavailable("the server is shutting down; retry on another replica")
        candidates = [w for w in self.workers if w.serving]
        if not candidates:
            raise Unavailable("no worker is ready to serve; retry shortly")
        if self.inflight_count() >= self.capacity():
            raise Overloaded(
                f"the server is at capacity ({self.capacity()} requests in flight, "
                f"queue size {self.settings.max_queue}); retry later"
            )
        worker = min(candidates, key=lambda w: len(w.inflight))
        # The engine's id is ours, unique; the caller's request_id stays in the servicer.
        request.request_id = uuid.uuid4().hex
        stream = RequestStream(self, worker, request.request_id)
        worker.inflight[request.request_id] = stream.queue
        self._send(worker, ("add", request))
        log.debug("request_dispatched", worker_id=worker.worker_id, load=len(worker.inflight))
        return stream


class RequestStream:
    """One admitted request's outputs, in order; closing it early cancels the request in its worker."""

    def __init__(self, router: Router, worker: WorkerHandle, engine_id: str) -> None:
        self.router = router
        self.worker = worker
        self.engine_id = engine_id
        self.queue: asyncio.Queue[RequestOutput | Exception] = asyncio.Queue()
        self.done = False
        self._timer: asyncio.TimerHandle | None = None

    def expire_after(self, seconds: float) -> None:
        """End the stream with DeadlineExceeded unless it finishes within `seconds`."""
        error = DeadlineExceeded("the deadline passed before generation ended")
        self._timer = asyncio.get_running_loop().call_later(max(0.0, seconds), self.queue.put_nowait, error)

    @property
    def worker_id(self) -> int:
        return self.worker.worker_id

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
        """Stop the request if its worker still runs it (the caller left, its deadline passed, or
        the server drained); the router forgets a request once it finished or its worker failed."""
        if self._timer is not None:
            self._timer.cancel()
        self.done = True
        if self.worker.inflight.pop(self.engine_id, None) is not None and self.worker.alive:
            self.router._send(self.worker, ("cancel", self.engine_id))
