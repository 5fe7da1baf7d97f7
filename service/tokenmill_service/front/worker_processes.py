"""Where worker processes come from.

On Linux, a fork server: a process started as ``tokenmill-server`` starts, before the router's own imports, that
imports what every worker imports (torch above all: seconds) while the router loads. Each worker, and each
restart of one, is then a fork of it: a worker starts without importing anything again, and exits without
tearing an interpreter down. The fork server never runs torch, so a fork of it inherits no thread pool and no
CUDA context. Elsewhere (macOS, where forking a process that loaded Apple's frameworks is unsafe, and Windows)
each worker is spawned: a fresh interpreter that imports it all itself.

A forked worker has the environment the fork server started with, not the server process's at the fork: what a
worker needs from the server process travels in its WorkerSpec, never through os.environ.
"""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import sys
from collections.abc import Sequence
from multiprocessing.context import ForkServerContext, SpawnContext

# The modules a worker imports before it serves: its entry point, the collectives (torch), the loader and the
# engine; the fork server imports them once.
PRELOADED = [
    "tokenmill_service.worker.worker",
    "tokenmill_service.worker.distributed.step_broadcast",
    "tokenmill_service.worker.loader",
    "tokenmill_service.worker.engine.warm_up",
    "tokenmill_service.worker.engine.native_stack",
    "tokenmill_service.worker.models.embedder",
]

# Arguments after which tokenmill-server prints and exits without starting any worker.
_NO_WORKERS = ("-h", "--help", "--version")


def forking() -> bool:
    """Whether workers are forked from the fork server (Linux) rather than spawned."""
    return sys.platform == "linux" and "forkserver" in mp.get_all_start_methods()


def context() -> ForkServerContext | SpawnContext:
    """The multiprocessing context that worker processes are started from."""
    return mp.get_context("forkserver") if forking() else mp.get_context("spawn")


def start_preloading(argv: Sequence[str]) -> None:
    """Starts the fork server (``tokenmill-server``'s arguments: none when they only ask for help), so that it
    imports the workers' modules beside the router's own imports. Its first fork waits for those imports."""
    if not forking() or any(arg in _NO_WORKERS for arg in argv) or importlib.util.find_spec("torch") is None:
        return
    from multiprocessing import forkserver

    mp.get_context("forkserver").set_forkserver_preload(PRELOADED)
    forkserver.ensure_running()
