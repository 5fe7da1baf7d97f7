"""Imported by the fork server alone, last of its preloaded modules (worker_processes.PRELOADED): when the server
process stops it, it leaves at once rather than tearing down an interpreter that has imported torch, which kept a
core busy for 0.5-0.8 s after the server process had gone (measured on a 2-core AMD EPYC). Its forks, the workers,
never run exit handlers: multiprocessing ends each with os._exit."""

from __future__ import annotations

import atexit
import os
import sys

_FORK_SERVER_PID = os.getpid()


def _leave_at_once() -> None:
    if os.getpid() == _FORK_SERVER_PID:  # (a fork inherits the handler, and never runs it)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


# Registered after every other preloaded module's handlers (torch's among them), so it runs first.
atexit.register(_leave_at_once)
