"""The router: spawns and supervises the replicas, sends each request to the least loaded one,
streams its outputs back, resumes the streams of a replica that dies or hangs on another one, and
cancels what callers abandon.

A replica is a group of processes (one per tensor-parallel rank; rank 0 holds the pipe and runs
the engine loop). It is declared dead as a whole when any of its processes exits, when its
heartbeats stop (`--heartbeat-timeout`: a stopped or wedged process) or when one step runs past
`--step-timeout` scaled to the step's size; then every process of the group is killed, its
requests are re-admitted elsewhere (prompt + the tokens already sent, same seed), and the group
is restarted with backoff.

It lives on the server's asyncio loop. Worker pipes and process sentinels are watched with
`loop.add_reader`, so there are no threads; commands for a worker are gathered and sent once
per loop turn. Nothing here imports torch.
"""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing as mp
import os
import secrets
import socket
import time
import uuid
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

import structlog

from tokenmill_service.config import Settings
from tokenmill_service.engine.config import EngineConfig
from tokenmill_service.engine.request import EngineStats, GenerationRequest, RequestOutput
from tokenmill_service.messages import (
    AddRequest,
    Cancel,
    Command,
    Event,
    Failed,
    Heartbeat,
    Ready,
    Shutdown,
    Stats,
    StepOutputs,
    WorkerInfo,
    WorkerSpec,
)
from tokenmill_service.messages import Rejected as RejectedMsg
from tokenmill_service.metrics import Metrics
from tokenmill_service.plan.options import LoadOptions
from tokenmill_service.worker import worker_main

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


# A step of up to this many tokens gets --step-timeout seconds; a larger one proportionally more.
STEP_TIMEOUT_TOKENS = 512
# A replica that served this long before dying restarts after the shortest backoff again.
HEALTHY_RUN_S = 60.0


@dataclass(eq=False)
class Replica:
    """One model replica: its processes (rank 0 first), the pipe to rank 0, and what it runs."""

    worker_id: int
    processes: list[BaseProcess]
    conn: Connection
    # The device of each rank ("cpu", "cuda:3"), in rank order.
    devices: list[str] = field(default_factory=list)
    restarts: int = 0
    # Consecutive deaths soon after starting; sets the backoff before the next start.
    failures: int = 0
    info: WorkerInfo | None = None
    alive: bool = True
    stats: EngineStats | None = None
    inflight: dict[str, InFlight] = field(default_factory=dict)
    pending: list[Command] = field(default_factory=list)
    ready: asyncio.Future[WorkerInfo] | None = None
    ready_at: float | None = None
    # When rank 0 was last heard from, and what its last heartbeat said about the step in progress.
    last_heard: float = field(default_factory=time.monotonic)
    step_elapsed: float | None = None
    step_tokens: int = 0

    @property
    def serving(self) -> bool:
        return self.alive and self.info is not None

    @property
    def process(self) -> BaseProcess:
        return self.processes[0]


@dataclass(eq=False)
class InFlight:
    """What the router keeps of an admitted request so it can resume it on another replica."""

    request: GenerationRequest  # as admitted: its seed is fixed, so a resumed draw is the same draw
    stream: RequestStream
    replica: Replica | None = None  # None while parked, waiting for a replica
    sent_ids: list[int] = field(default_factory=list)  # every token id handed to the caller
    delivered: bool = False  # the first output (with any prompt logprobs) has been handed over
    resumptions: int = 0


class Router:
    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.num_workers = settings.resolved_workers()
        self.workers: list[Replica] = []
        self.requests: dict[str, InFlight] = {}
        # Requests whose replica died while no other could take them; admitted on the next Ready.
        self.parked: list[InFlight] = []
        self.draining = False
        self.stopping = False
        # Set whenever a replica starts or stops serving, so health follows at once.
        self.state_changed = asyncio.Event()
        self._ctx = mp.get_context("spawn")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    # -- lifecycle ---------------------------------------------------------------------------

    def _spec(self, worker_id: int, rank: int, master_port: int) -> WorkerSpec:
        s = self.settings
        cores = os.cpu_count() or 1
        processes = self.num_workers * s.tensor_parallel
        threads = s.threads or (max(1, cores // processes) if s.device == "cpu" else 1)
        engine = EngineConfig(
            max_batch_size=s.max_batch_size,
            max_batch_tokens=max(s.max_batch_tokens, s.max_batch_size),
            block_size=s.block_size,
            kv_cache_memory=s.kv_cache_bytes,
            speculative_tokens=s.speculative_tokens,
            speculative_max_batch=s.speculative_max_batch,
        )
        return WorkerSpec(
            worker_id=worker_id,
            rank=rank,
            device_index=worker_id * s.tensor_parallel + rank,
            world_size=s.tensor_parallel,
            master_addr="127.0.0.1",
            master_port=master_port,
            options=LoadOptions.from_settings(s),
            engine=engine,
            threads=threads,
            log_format=s.resolved_log_format(),
            log_level=s.log_level,
            heartbeat_interval=min(0.5, s.heartbeat_timeout / 4),
            collective_timeout=s.step_timeout,
        )

    def _spawn(self, worker_id: int, restarts: int = 0, failures: int = 0) -> Replica:
        """Start a replica: one process per tensor-parallel rank, all in one torch.distributed group;
        only rank 0 gets a pipe (it runs the engine and broadcasts each step to the others)."""
        assert self._loop is not None
        parent, child = self._ctx.Pipe(duplex=True)
        s = self.settings
        master_port = (s.master_port + worker_id) if s.master_port else free_port()
        processes: list[BaseProcess] = []
        for rank in range(s.tensor_parallel):
            spec = self._spec(worker_id, rank, master_port)
            proc = self._ctx.Process(
                target=worker_main,
                args=(spec, child if rank == 0 else None),
                name=f"tokenmill-worker-{worker_id}" + (f"-rank-{rank}" if rank else ""),
            )
            proc.daemon = True
            proc.start()
            processes.append(proc)
        child.close()
        devices = [
            f"cuda:{worker_id * s.tensor_parallel + r}" if s.device == "cuda" else "cpu" for r in range(len(processes))
        ]
        replica = Replica(worker_id, processes, parent, restarts=restarts, failures=failures, devices=devices)
        replica.ready = self._loop.create_future()
        self._loop.add_reader(parent.fileno(), self._on_readable, replica)
        for p in replica.processes:
            self._loop.add_reader(p.sentinel, self._on_exit, replica)
        log.info("worker_spawned", worker_id=worker_id, pids=[p.pid for p in processes], master_port=master_port)
        return replica

    def _task(self, coro: object) -> None:
        task = asyncio.ensure_future(coro)  # type: ignore[call-overload]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def start(self, timeout: float = 600.0) -> None:
        """Spawn every replica and wait until each has loaded the model and run a warm-up step."""
        self._loop = asyncio.get_running_loop()
        self.workers = [self._spawn(i) for i in range(self.num_workers)]
        futures = [w.ready for w in self.workers if w.ready is not None]
        await asyncio.wait_for(asyncio.gather(*futures), timeout)
        self._task(self._supervise())

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
            for inflight in list(self.requests.values()):
                inflight.stream.queue.put_nowait(Unavailable("the server is shutting down"))

    async def stop(self) -> None:
        self.stopping = True
        for task in self._tasks:
            task.cancel()
        for w in self.workers:
            if w.alive:
                w.pending.append(Shutdown())
                self._flush(w)
        deadline = time.monotonic() + 10
        for w in self.workers:
            while any(p.is_alive() for p in w.processes) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            for p in w.processes:
                if p.is_alive():
                    log.warning("worker_killed", worker_id=w.worker_id, pid=p.pid, reason="did not stop in 10 s")
                    p.kill()
            self._forget(w)

    # -- supervision -----------------------------------------------------------------------------

    def step_bound(self, tokens: int) -> float:
        """How long a step of `tokens` tokens may run before its replica is declared hung."""
        return self.settings.step_timeout * max(1.0, tokens / STEP_TIMEOUT_TOKENS)

    async def _supervise(self) -> None:
        """Declare dead the replicas that stopped talking or whose step runs past its bound."""
        period = min(0.25, self.settings.heartbeat_timeout / 4)
        while not self.stopping:
            await asyncio.sleep(period)
            now = time.monotonic()
            for w in list(self.workers):
                if not w.serving:
                    continue  # a starting replica is bounded by its restart's own timeout
                silent = now - w.last_heard
                if silent > self.settings.heartbeat_timeout:
                    self._fail(
                        w, f"no heartbeat for {silent:.1f} s (--heartbeat-timeout {self.settings.heartbeat_timeout} s)"
                    )
                elif w.step_elapsed is not None:
                    elapsed, bound = w.step_elapsed + silent, self.step_bound(w.step_tokens)
                    if elapsed > bound:
                        self._fail(
                            w,
                            f"a step of {w.step_tokens} tokens has run {elapsed:.1f} s "
                            f"(--step-timeout allows {bound:.1f} s)",
                        )

    def _forget(self, w: Replica) -> None:
        assert self._loop is not None
        if w.alive:
            w.alive = False
            self.state_changed.set()
            self._loop.remove_reader(w.conn.fileno())
            for p in w.processes:
                self._loop.remove_reader(p.sentinel)
            w.conn.close()

    def _on_readable(self, w: Replica) -> None:
        try:
            while w.alive and w.conn.poll():
                self._handle(w, w.conn.recv())
        except (EOFError, OSError):
            self._on_exit(w)

    def _handle(self, w: Replica, event: Event) -> None:
        w.last_heard = time.monotonic()
        match event:
            case StepOutputs(outputs=outputs, stats=stats):
                w.stats, w.step_elapsed = stats, None
                for out in outputs:
                    inflight = w.inflight.get(out.request_id)
                    if inflight is None:
                        continue  # cancelled meanwhile
                    inflight.sent_ids.extend(t.id for t in out.tokens)
                    inflight.delivered = True
                    inflight.stream.queue.put_nowait(out)
                    if out.finished:
                        del w.inflight[out.request_id]
                        self.requests.pop(out.request_id, None)
            case Heartbeat(step_elapsed=elapsed, step_tokens=tokens):
                w.step_elapsed, w.step_tokens = elapsed, tokens
            case Stats(stats=stats):
                w.stats = stats
            case RejectedMsg(request_id=request_id, message=message):
                inflight = w.inflight.pop(request_id, None)
                self.requests.pop(request_id, None)
                if inflight is not None:
                    inflight.stream.queue.put_nowait(Rejected(message))
            case Ready(info=info):
                w.info, w.ready_at = info, time.monotonic()
                self.state_changed.set()
                log.info("worker_ready", worker_id=w.worker_id, pid=info.pid)
                if w.ready is not None and not w.ready.done():
                    w.ready.set_result(info)
                self._admit_parked()
            case Failed(message=message):
                log.error("worker_failed_to_start", worker_id=w.worker_id, error=message)
                if w.ready is not None and not w.ready.done():
                    w.ready.set_exception(WorkerStartError(f"worker {w.worker_id} failed to start: {message}"))

    def _on_exit(self, w: Replica) -> None:
        if not w.alive:
            return
        # Read whatever the worker sent before it went (its last outputs or its start error).
        try:
            while w.conn.poll():
                self._handle(w, w.conn.recv())
        except (EOFError, OSError):
            pass
        if not w.alive:
            return
        codes = []
        for p in w.processes:
            p.join(timeout=0 if p.is_alive() else 1)
            codes.append(p.exitcode)
        exited = next((c for c in codes if c is not None), None)
        self._fail(w, f"worker {w.worker_id} stopped (exit code {exited})")

    def _fail(self, w: Replica, reason: str) -> None:
        """Declare a replica dead: kill its whole group, resume its requests, schedule its restart."""
        if not w.alive:
            return
        was_serving = w.serving
        self._forget(w)
        for p in w.processes:
            if p.is_alive():
                p.kill()  # also ends a SIGSTOPped process
        for p in w.processes:
            p.join(timeout=5)
        lost = list(w.inflight.values())
        w.inflight.clear()
        if w.ready is not None and not w.ready.done():
            w.ready.set_exception(WorkerStartError(f"worker {w.worker_id} failed while starting: {reason}"))
        if self.stopping:
            for inflight in lost:
                inflight.stream.queue.put_nowait(Unavailable("the server is shutting down"))
            return
        if not was_serving:
            return  # a start that failed: the restart loop owns it
        log.error("worker_died", worker_id=w.worker_id, reason=reason, requests_to_resume=len(lost))
        self.metrics.worker_restarts.inc()
        for inflight in lost:
            self._resume(inflight, reason)
        self._task(self._restart(w, reason))

    async def _restart(self, dead: Replica, reason: str) -> None:
        # Back off harder while replicas keep dying soon after they start (a crash loop).
        quick = dead.ready_at is None or time.monotonic() - dead.ready_at < HEALTHY_RUN_S
        failures = dead.failures + 1 if quick else 1
        while not self.stopping:
            delay = min(30.0, 0.5 * 2 ** (failures - 1))
            log.info("worker_restart_scheduled", worker_id=dead.worker_id, delay_s=delay, reason=reason)
            await asyncio.sleep(delay)
            replica = self._spawn(dead.worker_id, restarts=dead.restarts + 1, failures=failures)
            self.workers[dead.worker_id] = replica
            try:
                assert replica.ready is not None
                await asyncio.wait_for(asyncio.shield(replica.ready), 600)
                log.info("worker_restarted", worker_id=dead.worker_id, restarts=replica.restarts)
                return
            except (WorkerStartError, asyncio.TimeoutError) as exc:
                reason = str(exc) or "not ready within 600 s"
                log.error("worker_restart_failed", worker_id=dead.worker_id, error=reason)
                self._forget(replica)
                for p in replica.processes:
                    if p.is_alive():
                        p.kill()
                dead, failures = replica, failures + 1

    # -- resumption ------------------------------------------------------------------------------

    def _resume(self, inflight: InFlight, reason: str) -> None:
        """Re-admit a request whose replica died: prompt + the tokens already sent, same seed."""
        limit = self.settings.max_resumptions
        if inflight.resumptions >= limit:
            self._drop(inflight)
            moved = f"it was already resumed {inflight.resumptions} times" if limit else "resumption is off"
            inflight.stream.queue.put_nowait(
                Unavailable(f"{reason}; {moved} (--max-resumptions {limit}); retry the request")
            )
            return
        inflight.resumptions += 1
        inflight.replica = None
        target = self._pick()
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

    def _admit_parked(self) -> None:
        parked, self.parked = self.parked, []
        for inflight in parked:
            target = self._pick()
            if target is None:
                self.parked.append(inflight)
            else:
                self._dispatch(inflight, target)

    def _dispatch(self, inflight: InFlight, replica: Replica) -> None:
        request = inflight.request
        if inflight.delivered:
            # The engine prefills prompt + sent tokens and primes its detokenizer with them, emitting nothing twice.
            request = dataclasses.replace(request, resume_ids=list(inflight.sent_ids), prompt_logprobs=False)
        inflight.replica = replica
        replica.inflight[request.request_id] = inflight
        self._send(replica, AddRequest(request))

    def _drop(self, inflight: InFlight) -> None:
        """Forget a request (finished, failed or abandoned); cancel it in its replica if it still runs it."""
        request_id = inflight.request.request_id
        self.requests.pop(request_id, None)
        if inflight in self.parked:
            self.parked.remove(inflight)
        replica, inflight.replica = inflight.replica, None
        if replica is not None and replica.inflight.pop(request_id, None) is not None and replica.alive:
            self._send(replica, Cancel(request_id))

    def _pick(self) -> Replica | None:
        candidates = [w for w in self.workers if w.serving]
        return min(candidates, key=lambda w: len(w.inflight)) if candidates else None

    # -- requests ------------------------------------------------------------------------------

    def _send(self, w: Replica, cmd: Command) -> None:
        assert self._loop is not None
        if not w.pending:
            self._loop.call_soon(self._flush, w)
        w.pending.append(cmd)

    def _flush(self, w: Replica) -> None:
        cmds, w.pending = w.pending, []
        if cmds and w.alive:
            try:
                w.conn.send(cmds)
            except (BrokenPipeError, OSError):
                self._on_exit(w)

    def inflight_count(self) -> int:
        return len(self.requests)

    def capacity(self) -> int:
        serving = sum(1 for w in self.workers if w.serving)
        return serving * self.settings.max_batch_size + self.settings.max_queue

    def submit(self, request: GenerationRequest) -> RequestStream:
        """Admit one request (or raise Unavailable / Overloaded at once) and stream its outputs."""
        if self.draining:
            raise Unavailable("the server is shutting down; retry on another replica")
        worker = self._pick()
        if worker is None:
            raise Unavailable("no worker is ready to serve; retry shortly")
        if self.inflight_count() >= self.capacity():
            raise Overloaded(
                f"the server is at capacity ({self.capacity()} requests in flight, "
                f"queue size {self.settings.max_queue}); retry later"
            )
        # The engine's id is ours, unique; the caller's request_id stays in the servicer.
        request.request_id = uuid.uuid4().hex
        if request.sampling.seed is None:
            # Fixed now, so that a resumed request continues the same random stream.
            request.sampling.seed = secrets.randbits(63)
        stream = RequestStream(self)
        inflight = InFlight(request, stream)
        stream.inflight = inflight
        self.requests[request.request_id] = inflight
        self._dispatch(inflight, worker)
        log.debug("request_dispatched", worker_id=worker.worker_id, load=len(worker.inflight))
        return stream


class RequestStream:
    """One admitted request's outputs, in order, across resumptions; closing it early cancels it."""

    inflight: InFlight

    def __init__(self, router: Router) -> None:
        self.router = router
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
        self.router._drop(self.inflight)
