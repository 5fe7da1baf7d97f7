"""Starting and stopping as a person at a terminal expects, against the real server process.

A second Ctrl-C (or SIGTERM) during the drain stops the server at once.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from typing import Any

import grpc
import pytest

from tests.server_process import ServerProcess
from tokenmill_client._proto import generate_pb2 as pb
from tokenmill_client._proto import generate_pb2_grpc as pb_grpc


def log_events(server: ServerProcess, event: str) -> list[dict[str, Any]]:
    lines = [line for line in server.logs().splitlines() if line.startswith("{") and f'"{event}"' in line]
    return [e for e in map(json.loads, lines) if e.get("event") == event]


def gone(pid: int) -> bool:
    """Whether the process has exited (a zombie waiting for its parent counts as exited)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except FileNotFoundError:
        return True


@pytest.mark.parametrize("second", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_second_signal_during_the_drain_stops_at_once(second: signal.Signals) -> None:
    server = ServerProcess("--drain-seconds", "120").start()
    outcome: dict[str, Any] = {}
    streaming = threading.Event()
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.GenerationStub(channel)

            def in_flight() -> None:
                stopping = pb.StoppingParams(max_new_tokens=4000, ignore_eos=True)
                try:
                    for _ in stub.Generate(pb.GenerateRequest(prompt="Write a long poem", stopping=stopping)):
                        streaming.set()
                    outcome["finished"] = True
                except grpc.RpcError as err:
                    outcome["code"] = err.code()

            thread = threading.Thread(target=in_flight)
            thread.start()
            assert streaming.wait(60), "the in-flight request never started streaming"
            assert server.proc is not None
            server.proc.send_signal(signal.SIGINT)
            deadline = time.monotonic() + 10
            while not log_events(server, "draining") and time.monotonic() < deadline:
                time.sleep(0.1)
            [draining] = log_events(server, "draining")
            # It says how long it will wait, for how many calls, and how not to wait.
            assert draining["drain_seconds"] == 120 and draining["in_flight"] == 1, draining
            assert draining["signal"] == "SIGINT" and "again" in draining["hint"]
            assert server.proc.poll() is None  # draining, not gone

            started = time.monotonic()
            server.proc.send_signal(second)
            code = server.proc.wait(15)
            assert time.monotonic() - started < 10
            assert code == 128 + second.value
            thread.join(15)
    finally:
        server.stop()
    [stopping_now] = log_events(server, "stopping_now")
    assert stopping_now["signal"] == second.name and stopping_now["in_flight"] == 1
    assert log_events(server, "workers_killed")
    assert [e["exit_code"] for e in log_events(server, "server_stopped")] == [128 + second.value]
    worker_pids = [e["pid"] for e in log_events(server, "worker_ready") if "pid" in e]
    assert worker_pids and all(gone(pid) for pid in worker_pids)
    # The call in flight is ended, not left hanging.
    assert "finished" not in outcome and outcome.get("code") in (
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.CANCELLED,
    ), outcome
