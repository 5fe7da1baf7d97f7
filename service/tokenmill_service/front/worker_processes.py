"""Where worker processes come from.

On Linux, a fork server: a process started as ``tokenmill-server`` starts, before the router's own imports, that
imports what every worker imports (torch above all: seconds) while the router loads. Each worker, and each
restart of one, is then a fork of it: a worker starts without importing anything again, and exits without
tearing an interpreter down. The fork server never runs torch, so a fork of it inherits no thread pool and no
CUDA context. Elsewhere (macOS, where forking a process that loaded Apple's frameworks is unsafe, and Windows)
each worker is spawned: a fresh interpreter that imports it all itself.

A forked worker has the environment the fork server started with, not the server process's at the fork: what a
worker needs from the server process travels in its WorkerSpec, never through os.environ.

The server process stops its helper processes (the fork server, and multiprocessing's resource tracker) before it
exits and waits for them (stop_helpers), so that when it has exited nothing it started is left running.
"""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import os
import signal
import sys
import threading
from collections.abc import Sequence
from multiprocessing.context import ForkServerContext, SpawnContext
from typing import Any

# The modules a worker imports before it serves: its entry point, the collectives (torch), the loader and the
# engine; the fork server imports them once.
PRELOADED = [
    "tokenmill_service.worker.worker",
    "tokenmill_service.worker.distributed.step_broadcast",
    "tokenmill_service.worker.loader",
    "tokenmill_service.worker.engine.warm_up",
    "tokenmill_service.worker.engine.native_stack",
    "tokenmill_service.worker.models.embedder",
    "tokenmill_service.front.fork_server",  # last: the fork server's quick exit (see there)
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


def stop_helpers(timeout: float = 10.0) -> None:
    """Stops the fork server and the resource tracker where this process started them, and waits for each to exit:
    each is told to stop by the closing of its pipe from this process, as it would be when this process exits; one
    still running after ``timeout`` seconds is killed."""
    from multiprocessing import forkserver, resource_tracker

    # multiprocessing's own stop-and-wait for each (``_stop``, private: there is no public one).
    helpers: list[tuple[Any, str]] = [
        (forkserver._forkserver, "_forkserver_pid"),
        (resource_tracker._resource_tracker, "_pid"),
    ]
    for helper, pid_field in helpers:
        pid = getattr(helper, pid_field, None)
        if pid is None:
            continue  # not started by this process
        killer = threading.Timer(timeout, os.kill, (pid, signal.SIGKILL))
        killer.start()
        try:
            helper._stop()
        except OSError:
            pass  # already gone (ChildProcessError: reaped)
        finally:
            killer.cancel()
