"""A node above 0 of a replica spanning several servers (``--nnodes``, ``--node-rank``): it runs this
node's ranks of the replica's tensor-parallel group, and nothing else (no router, no APIs).

Its ranks meet node 0's at ``--master-addr``:``--master-port`` and follow the steps rank 0
broadcasts, like any rank above 0. When one of them ends (a rank failed, or node 0's replica was
restarted and its collectives broke), every local rank is stopped and all are started again after a
backoff, so that they join the replica's next incarnation; node 0 restarts its side the same way.
On Kubernetes the chart runs the nodes as one LeaderWorkerSet group, which also restarts the group
whole when a pod fails. SIGTERM or SIGINT stops the ranks and exits 0.
"""

from __future__ import annotations

import asyncio
import signal
import time
from multiprocessing.connection import wait
from multiprocessing.context import ForkServerContext, SpawnContext
from multiprocessing.process import BaseProcess
from typing import Any

import structlog

from tokenmill_service.contract.config import Settings
from tokenmill_service.front import worker_processes
from tokenmill_service.front.router.spec import worker_spec
from tokenmill_service.worker.worker import worker_main

log = structlog.get_logger("tokenmill.node")

# Ranks that ran this long before ending start again after the shortest backoff.
HEALTHY_RUN_S = 60.0


async def serve_follower_node(settings: Settings) -> int:
    ctx = worker_processes.context()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    port = settings.resolved_master_port()
    failures = 0
    while not stop.is_set():
        processes = [_spawn(ctx, settings, rank, port) for rank in settings.node_ranks()]
        started = time.monotonic()
        log.info(
            "node_ranks_started",
            node_rank=settings.node_rank,
            ranks=settings.node_ranks(),
            pids=[p.pid for p in processes],
            master=f"{settings.master_addr}:{port}",
        )
        ended = asyncio.ensure_future(loop.run_in_executor(None, _wait_any, processes))
        stopping = asyncio.ensure_future(stop.wait())
        either: set[asyncio.Future[Any]] = {ended, stopping}
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        for p in processes:
            if p.is_alive():
                p.kill()
        for p in processes:
            p.join(timeout=5)
        await ended
        stopping.cancel()
        if stop.is_set():
            break
        failures = failures + 1 if time.monotonic() - started < HEALTHY_RUN_S else 1
        delay = min(10.0, 0.5 * 2 ** (failures - 1))
        log.warning("node_ranks_ended", exit_codes=[p.exitcode for p in processes], restart_in_s=delay)
        try:
            await asyncio.wait_for(stop.wait(), delay)
        except asyncio.TimeoutError:
            pass
    log.info("node_stopped", node_rank=settings.node_rank)
    return 0


def _spawn(ctx: ForkServerContext | SpawnContext, settings: Settings, rank: int, port: int) -> BaseProcess:
    spec = worker_spec(settings, 1, 0, rank, port)
    proc = ctx.Process(target=worker_main, args=(spec, None), name=f"tokenmill-rank-{rank}")
    proc.daemon = True
    proc.start()
    return proc


def _wait_any(processes: list[BaseProcess]) -> None:
    """Block until one of `processes` has ended (run in a thread)."""
    while all(p.is_alive() for p in processes):
        wait([p.sentinel for p in processes], timeout=1.0)
