"""A real tokenmill-server in a subprocess on a free loopback port, for integration tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import IO

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from typing_extensions import Self

SERVER = Path(sys.executable).parent / "tokenmill-server"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def health_status(address: str, timeout: float = 2.0) -> int | None:
    """The overall health status, or None when nothing answers."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.RpcError:
            return None
        return int(reply.status)


def reflected_services(address: str, version: str, metadata: list[tuple[str, str]] | None = None) -> set[str]:
    """The services server reflection (``version``: v1 or v1alpha) lists; grpc.RpcError where it refuses."""
    from grpc_reflection.v1alpha import reflection_pb2 as rpb

    with grpc.insecure_channel(address) as channel:
        call = channel.stream_stream(
            f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
            request_serializer=rpb.ServerReflectionRequest.SerializeToString,
            response_deserializer=rpb.ServerReflectionResponse.FromString,
        )
        (reply,) = call(iter([rpb.ServerReflectionRequest(list_services="")]), metadata=metadata, timeout=30)
        return {s.name for s in reply.list_services_response.service}


class ServerProcess:
    def __init__(
        self,
        *args: str,
        env: dict[str, str] | None = None,
        metrics: bool = False,
        host: str = "127.0.0.1",
        port: int | None = None,
    ) -> None:
        self.host = host
        self.port = port or free_port()
        self.address = f"{host}:{self.port}"
        self.metrics_port = free_port() if metrics else 0
        # The OpenAI-compatible HTTP API is on by default; each server gets its own port (not 8000).
        self.http_port = free_port()
        self.http_url = f"http://{host}:{self.http_port}"
        self.args = [str(SERVER), "--host", host, "--port", str(self.port), "--log-format", "json"]
        self.args += ["--http-port", str(self.http_port), *args]
        if metrics:
            self.args += ["--metrics-port", str(self.metrics_port)]
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        # The bearer token the server wants (its /metrics included), if the flags give one.
        flags = list(args)
        self.token = next((flags[i + 1] for i, a in enumerate(flags[:-1]) if a in ("--auth-token", "--api-key")), None)
        self.log: IO[str] = tempfile.NamedTemporaryFile("w+", suffix=".log", prefix="tokenmill-server-")  # noqa: SIM115
        self.proc: subprocess.Popen[str] | None = None

    def launch(self) -> ServerProcess:
        """Start the process without waiting for it to serve (a --node-rank above 0 never does)."""
        self.proc = subprocess.Popen(self.args, env=self.env, stdout=self.log, stderr=subprocess.STDOUT, text=True)
        return self

    def start(self, timeout: float = 180.0) -> ServerProcess:
        self.launch()
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tokenmill-server exited with {self.proc.returncode}:\n{self.logs()[-4000:]}")
            if health_status(self.address, timeout=1.0) == health_pb2.HealthCheckResponse.SERVING:
                return self
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"tokenmill-server not SERVING after {timeout}s:\n{self.logs()[-4000:]}")

    def metric(self, name: str) -> float | None:
        """One sample of ``name`` from the Prometheus endpoint (started with ``metrics=True``); None if absent."""
        request = urllib.request.Request(f"http://{self.host}:{self.metrics_port}/metrics")
        if self.token is not None:
            request.add_header("Authorization", f"Bearer {self.token}")
        body = urllib.request.urlopen(request, timeout=10).read().decode()
        for line in body.splitlines():
            if line.startswith((name + " ", name + "{")):
                return float(line.rsplit(" ", 1)[1])
        return None

    def logs(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()

    def stop(self, timeout: float = 60.0) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
