"""The replicas: spawning each one's processes, reading their pipes, supervising them (heartbeats,
step bounds, exits) and restarting a dead one with backoff.

A replica is a group of processes (one per tensor-parallel rank; rank 0 holds the pipe and runs
the engine loop). It is declared dead as a whole when any of its processes exits, when its
heartbeats stop (`--heartbeat-timeout`: a stopped or wedged process) or when one step runs past
`--step-timeout` scaled to the step's size; then every process of the group is killed, the
dispatcher is handed the requests it was running (to resume elsewhere), and the group is
restarted with backoff.

Worker pipes and process sentinels are watched with `loop.add_reader` on the server's asyncio loop,
so there are no threads; commands for a worker are gathered and sent once per loop turn. What the
pool knows of requests is only which ones each replica runs (`Replica.inflight`: its load).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Protocol

import structlog

from tokenmill_service.contract.config import Settings
from tokenmill_service.contract.messages import (
    AdapterResult,
    Command,
    Embedded,
    Event,
    Failed,
    Heartbeat,
    Ready,
    Rejected,
    Shutdown,
    Stats,
    StepOutputs,
    WorkerInfo,
)
from tokenmill_service.contract.request import EngineStats, RequestOutput
from tokenmill_service.front import worker_processes
from tokenmill_service.front.metrics import Metrics
from tokenmill_service.front.router.errors import WorkerStartError
from tokenmill_service.front.router.spec import free_port, worker_spec
from tokenmill_service.front.router.streams import InFlight
from tokenmill_service.worker.worker import worker_main

log = structlog.get_logger("tokenmill.router")

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
    # The requests this replica runs, by the engine's request id (its load, for dispatch).
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


class ReplicaListener(Protocol):
    """What the pool tells the dispatcher about requests and replicas."""

    def on_outputs(self, replica: Replica, outputs: Sequence[RequestOutput]) -> None: ...

    def on_rejected(self, replica: Replica, request_id: str, message: str) -> None: ...

    def on_ready(self, replica: Replica) -> None: ...

    def on_adapter_result(self, replica: Replica, result: AdapterResult) -> None: ...

    def on_embedded(self, replica: Replica, answer: Embedded) -> None: ...

    def on_replica_lost(self, replica: Replica, reason: str) -> None:
        """A replica died (its embedding calls, which are not resumed, fail)."""
        ...

    def on_lost(self, lost: list[InFlight], reason: str) -> None:
        """A replica died with these requests (to resume, unless the pool is stopping)."""
        ...


class ReplicaPool:
    """``settings.resolved_workers()`` replicas, each kept running until ``stop``."""

    def __init__(self, settings: Settings, metrics: Metrics, listener: ReplicaListener) -> None:
        self.settings = settings
        self.metrics = metrics
        self.listener = listener
        self.num_workers = settings.resolved_workers()
        self.replicas: list[Replica] = []
        self.stopping = False
        # Set whenever a replica starts or stops serving, so health follows at once.
        self.state_changed = asyncio.Event()
        self._ctx = worker_processes.context()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        # Processes started (in a thread) whose replica is not registered yet: stop() and kill() end them too.
        self._unclaimed: list[BaseProcess] = []
        # The LoRA adapters served (name -> path): what a replica starts (or restarts) with.
        self.adapters: dict[str, str] = settings.lora_module_paths()

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self, timeout: float) -> None:
        """Spawn every replica and wait until each has loaded the model and run a warm-up step."""
        self._loop = asyncio.get_running_loop()
        for i in range(self.num_workers):
            self.replicas.append(await self._spawn(i))
        futures = [w.ready for w in self.replicas if w.ready is not None]
        await asyncio.wait_for(asyncio.gather(*futures), timeout)
        self._task(self._supervise())

    async def stop(self) -> None:
        self.stopping = True
        self._kill_unclaimed()
        for task in self._tasks:
            task.cancel()
        for w in self.replicas:
            if w.alive:
                w.pending.append(Shutdown())
                self._flush(w)
        deadline = time.monotonic() + 10
        for w in self.replicas:
            while any(p.is_alive() for p in w.processes) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            for p in w.processes:
                if p.is_alive():
                    log.warning("worker_killed", worker_id=w.worker_id, pid=p.pid, reason="did not stop in 10 s")
                    p.kill()
            self._forget(w)

    def kill(self) -> None:
        """Kill every worker process now (SIGKILL), without asking them to stop or waiting."""
        self.stopping = True
        self._kill_unclaimed()
        for task in self._tasks:
            task.cancel()
        for w in self.replicas:
            for p in w.processes:
                if p.is_alive():
                    p.kill()
            self._forget(w)
        for w in self.replicas:
            for p in w.processes:
                p.join(timeout=1)
        log.warning("workers_killed", workers=len(self.replicas))

    def _kill_unclaimed(self) -> None:
        for p in list(self._unclaimed):
            if p.is_alive():
                p.kill()

    def serving(self) -> list[Replica]:
        return [w for w in self.replicas if w.serving]

    async def _spawn(self, worker_id: int, restarts: int = 0, failures: int = 0) -> Replica:
        """Start a replica: one process per tensor-parallel rank, all in one torch.distributed group;
        only rank 0 gets a pipe (it runs the engine and broadcasts each step to the others)."""
        assert self._loop is not None
        s = self.settings
        first_port = s.resolved_master_port()
        own_ports = {s.port, s.http_port, s.metrics_port}
        master_port = (first_port + worker_id) if first_port else free_port(avoid=own_ports)
        # In a thread: the first fork waits for the fork server's imports (seconds), and the loop serves meanwhile.
        parent, processes = await asyncio.to_thread(self._start_processes, worker_id, master_port)
        for p in processes:  # in place: another replica's start may be appending in its thread
            self._unclaimed.remove(p)
        devices = [
            f"cuda:{worker_id * len(processes) + r}" if s.device == "cuda" else "cpu" for r in range(len(processes))
        ]
        replica = Replica(worker_id, processes, parent, restarts=restarts, failures=failures, devices=devices)
        replica.ready = self._loop.create_future()
        self._loop.add_reader(parent.fileno(), self._on_readable, replica)
        for p in replica.processes:
            self._loop.add_reader(p.sentinel, self._on_exit, replica)
        log.info("worker_spawned", worker_id=worker_id, pids=[p.pid for p in processes], master_port=master_port)
        return replica

    def _start_processes(self, worker_id: int, master_port: int) -> tuple[Connection, list[BaseProcess]]:
        parent, child = self._ctx.Pipe(duplex=True)
        s = self.settings
        processes: list[BaseProcess] = []
        # With --nnodes above 1, only this node's ranks (rank 0 first); the others run on the other nodes.
        for rank in s.node_ranks():
            spec = worker_spec(s, self.num_workers, worker_id, rank, master_port, dict(self.adapters))
            proc = self._ctx.Process(
                target=worker_main,
                args=(spec, child if rank == 0 else None),
                name=f"tokenmill-worker-{worker_id}" + (f"-rank-{rank}" if rank else ""),
            )
            proc.daemon = True
            proc.start()
            self._unclaimed.append(proc)
            processes.append(proc)
            if self.stopping:  # stop() or kill() came while it started, and may have missed it
                proc.kill()
        child.close()
        return parent, processes

    def _task(self, coro: object) -> None:
        task = asyncio.ensure_future(coro)  # type: ignore[call-overload]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- commands ----------------------------------------------------------------------------

    def send(self, w: Replica, cmd: Command) -> None:
        """Queue a command for the replica; everything queued in one loop turn goes in one message."""
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

    # -- events ------------------------------------------------------------------------------

    def _on_readable(self, w: Replica) -> None:
        # One message a call: the loop watches the pipe level-triggered, so it calls again at once while
        # more is there, and no readiness check costs a poll of its own (Connection.poll builds a selector
        # each time, a fair part of the router's time per streamed token).
        if not w.alive:
            return
        try:
            self._handle(w, w.conn.recv())
        except (EOFError, OSError):
            self._on_exit(w)

    def _handle(self, w: Replica, event: Event) -> None:
        w.last_heard = time.monotonic()
        match event:
            case StepOutputs(outputs=outputs, stats=stats):
                w.stats, w.step_elapsed = stats, None
                self.listener.on_outputs(w, outputs)
            case Heartbeat(step_elapsed=elapsed, step_tokens=tokens):
                w.step_elapsed, w.step_tokens = elapsed, tokens
            case Stats(stats=stats):
                w.stats = stats
            case Rejected(request_id=request_id, message=message):
                self.listener.on_rejected(w, request_id, message)
            case AdapterResult():
                self.listener.on_adapter_result(w, event)
            case Embedded():
                self.listener.on_embedded(w, event)
            case Ready(info=info):
                w.info, w.ready_at = info, time.monotonic()
                self.state_changed.set()
                log.info("worker_ready", worker_id=w.worker_id, pid=info.pid)
                if w.ready is not None and not w.ready.done():
                    w.ready.set_result(info)
                self.listener.on_ready(w)
            case Failed(message=message, usage=usage):
                log.error("worker_failed_to_start", worker_id=w.worker_id, error=message)
                if w.ready is not None and not w.ready.done():
                    why = "cannot serve this" if usage else "failed to start"
                    w.ready.set_exception(WorkerStartError(f"worker {w.worker_id} {why}: {message}", usage))

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

    # -- supervision -------------------------------------------------------------------------

    def step_bound(self, tokens: int) -> float:
        """How long a step of `tokens` tokens may run before its replica is declared hung."""
        return self.settings.step_timeout * max(1.0, tokens / STEP_TIMEOUT_TOKENS)

    async def _supervise(self) -> None:
        """Declare dead the replicas that stopped talking or whose step runs past its bound."""
        period = min(0.25, self.settings.heartbeat_timeout / 4)
        while not self.stopping:
            await asyncio.sleep(period)
            now = time.monotonic()
            for w in list(self.replicas):
                if not w.serving:
                    continue  # a starting replica is bounded by its restart's own timeout
                if w.alive and w.conn.poll():
                    # Its messages are waiting to be read: the replica talks, this process was the one held
                    # up (a long stall of the event loop, or the server process stopped and continued).
                    continue
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

    def _fail(self, w: Replica, reason: str) -> None:
        """Declare a replica dead: kill its whole group, hand its requests back, schedule its restart."""
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
        self.listener.on_replica_lost(w, reason)
        if w.ready is not None and not w.ready.done():
            w.ready.set_exception(WorkerStartError(f"worker {w.worker_id} failed while starting: {reason}"))
        if self.stopping:
            self.listener.on_lost(lost, reason)
            return
        if not was_serving:
            return  # a start that failed: the restart loop owns it
        log.error("worker_died", worker_id=w.worker_id, reason=reason, requests_to_resume=len(lost))
        self.metrics.worker_restarts.inc()
        self.listener.on_lost(lost, reason)
        self._task(self._restart(w, reason))

    async def _restart(self, dead: Replica, reason: str) -> None:
        # Back off harder while replicas keep dying soon after they start (a crash loop).
        quick = dead.ready_at is None or time.monotonic() - dead.ready_at < HEALTHY_RUN_S
        failures = dead.failures + 1 if quick else 1
        while not self.stopping:
            delay = min(30.0, 0.5 * 2 ** (failures - 1))
            log.info("worker_restart_scheduled", worker_id=dead.worker_id, delay_s=delay, reason=reason)
            await asyncio.sleep(delay)
            replica = await self._spawn(dead.worker_id, restarts=dead.restarts + 1, failures=failures)
            self.replicas[dead.worker_id] = replica
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
