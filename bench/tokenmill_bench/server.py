"""A tokenmill-server subprocess on a free loopback port, for a benchmark run that brings its own server."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, TYPE_CHECKING

from tokenmill_client import Client, HealthStatus, TokenmillError

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self needs Python 3.11


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_executable() -> str:
    """tokenmill-server beside this interpreter (the same virtualenv), else the one on PATH."""
    beside = Path(sys.executable).parent / "tokenmill-server"
    if beside.exists():
        return str(beside)
    found = shutil.which("tokenmill-server")
    if found is None:
        raise FileNotFoundError("tokenmill-server is not installed here; install tokenmill[server] or pass --server")
    return found


class ManagedServer:
    """Starts ``tokenmill-server`` and waits for grpc.health SERVING; ``stop()`` sends SIGTERM (a clean drain).

    Its gRPC and HTTP ports are free ones (the HTTP default, 8000, is often a developer's own server's),
    unless ``extra_args`` names them. Its log is kept at ``log_path`` (a new temporary file when None)
    after the run, since that is where the benchmark's own log line points."""

    def __init__(self, extra_args: Sequence[str] = (), log_path: Path | None = None) -> None:
        extra = list(extra_args)
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.args = [server_executable(), "--host", "127.0.0.1", "--port", str(self.port), "--log-format", "json"]
        self.http_port: int | None = None  # as the server's flags have it when extra_args name it
        if not any(a == "--http-port" or a.startswith("--http-port=") for a in extra):
            self.http_port = free_port()
            self.args += ["--http-port", str(self.http_port)]
        self.args += extra
        # The server's own logs go to a file: they would interleave with the table otherwise.
        if log_path is None:
            self.log: IO[str] = tempfile.NamedTemporaryFile(  # noqa: SIM115
                "w+", suffix=".log", prefix="tokenmill-bench-server-", delete=False
            )
        else:
            self.log = open(log_path, "w+")  # noqa: SIM115 - closed by close()
        self.proc: subprocess.Popen[str] | None = None
        self.startup_s: float | None = None

    @property
    def log_path(self) -> str:
        return self.log.name

    def start(self, timeout: float = 300.0) -> Self:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        began = time.monotonic()
        self.proc = subprocess.Popen(self.args, env=env, stdout=self.log, stderr=subprocess.STDOUT, text=True)
        with Client(self.address, max_retries=0) as client:
            while time.monotonic() - began < timeout:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"tokenmill-server exited with {self.proc.returncode}:\n{self.tail()}")
                try:
                    if client.health(timeout=1.0) == HealthStatus.SERVING:
                        self.startup_s = time.monotonic() - began
                        return self
                except TokenmillError:
                    pass  # not listening yet
                time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"tokenmill-server was not SERVING after {timeout:.0f}s:\n{self.tail()}")

    def tail(self, chars: int = 4000) -> str:
        """The end of the server's log; ``chars=-1`` for all of it."""
        self.log.flush()
        text = Path(self.log.name).read_text()
        return text if chars < 0 else text[-chars:]

    def pids(self) -> list[int]:
        """The server's process and its descendants (the worker processes), for memory readings."""
        if self.proc is None:
            return []
        found, todo = [], [self.proc.pid]
        while todo:
            pid = todo.pop()
            found.append(pid)
            try:
                children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
            except OSError:
                continue
            todo.extend(int(c) for c in children)
        return found

    def stop(self, timeout: float = 60.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def close(self) -> None:
        self.stop()
        self.log.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
