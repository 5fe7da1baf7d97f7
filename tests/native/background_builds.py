"""The kernels' other builds (runner.other_builds), for the suite in the background: ``python -m
tests.native.background_builds``, started by runner.start_the_other_builds in a session of its own.

Why a process in its own session: where Linux groups the CPU's time by session (autogroup, the default on
desktop and many server kernels), a thread's nice ranks it only within its session's group, and the tests
start servers in sessions of their own (``make run`` in a terminal, the CLI's terminal tests). Beside builds at
nice 19 in the tests' own session, such a server got half the CPU: its two compute threads on one core, each
waiting on the other, served ten times slower. Here the whole group is at the lowest priority."""

from __future__ import annotations

import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

from tests.native import runner
from tokenmill_service.worker.kernels.cpu import build

stop = threading.Event()


def one(job: runner.Job) -> None:
    if not stop.is_set():
        try:
            build.built(*job)
        except build.NativeKernelUnavailable:
            pass  # (the test that loads it says why)


def main() -> None:
    if os.getsid(0) == os.getpid():  # the leader of its own session (as runner starts it), not someone's shell's
        try:
            Path("/proc/self/autogroup").write_text("19")  # the session's group (Linux, where autogroup is on)
        except OSError:
            pass
    os.nice(19)  # and each of its threads and compilers
    # SIGTERM (the suite's end): no new build starts; those under way finish (each is renamed in whole).
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    parent = os.getppid()
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        futures = [pool.submit(one, job) for job in runner.other_builds()]
        while wait(futures, timeout=0.5).not_done:
            if os.getppid() != parent:  # the suite was killed (no SIGTERM came): stop as at its end
                stop.set()


if __name__ == "__main__":
    main()
