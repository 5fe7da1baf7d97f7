"""The engine tests' torch.distributed ranks, each a process, forked from a fork server as the server's workers
are (tokenmill_service/front/worker_processes.py): the fork server imports torch, tokenmill's worker and the
rank functions' modules once, and a rank starts without importing them again (seconds a rank, spawned).

The fork server keeps the environment it started with (the suite's): a test that changes os.environ for its
ranks must pass the value in their arguments instead."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp
from torch.multiprocessing.spawn import start_processes

from tokenmill_service.front.worker_processes import PRELOADED

PRELOADED_HERE = [*PRELOADED, "tests.engine.family_checks", "transformers"]


def run_ranks(fn: Callable[..., None], args: tuple[Any, ...], nprocs: int) -> None:
    """``fn(rank, *args)`` in ``nprocs`` processes, until each returns (torch.multiprocessing.spawn's contract:
    a rank's exception is raised here)."""
    mp.set_forkserver_preload(PRELOADED_HERE)  # read when the fork server starts: the first call's
    start_processes(fn, args=args, nprocs=nprocs, start_method="forkserver")  # type: ignore[no-untyped-call]
