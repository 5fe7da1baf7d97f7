"""Starting and stopping as a person at a terminal expects, against the real server process.

A second Ctrl-C (or SIGTERM) during the drain stops the server at once; a client started before
the server waits for it (saying so once) and gets its answer.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.server_process import ServerProcess
from tokenmill_client._proto import generate_pb2 as pb
from tokenmill_client._proto import generate_pb2_grpc as pb_grpc

CLIENT = Path(sys.executable).parent / "tokenmill-client"


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


def left_behind(mark: str) -> list[int]:
    """The live processes whose environment carries ``TOKENMILL_TEST_MARK=mark``: a server given it, and every
    process it started (its workers and their fork server), inherit it."""
    needle = f"TOKENMILL_TEST_MARK={mark}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if needle in (entry / "environ").read_bytes().split(b"\0") and not gone(int(entry.name)):
                    found.append(int(entry.name))
            except OSError:
                pass  # gone meanwhile, or not ours to read
    return found


@pytest.mark.parametrize("second", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_second_signal_during_the_drain_stops_at_once(second: signal.Signals) -> None:
    mark = uuid.uuid4().hex
    server = ServerProcess("--drain-seconds", "120", env={"TOKENMILL_TEST_MARK": mark}).start()
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
    deadline = time.monotonic() + 10  # nor the fork server the workers came from
    while left_behind(mark) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left_behind(mark)
    # The call in flight is ended, not left hanging.
    assert "finished" not in outcome and outcome.get("code") in (
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.CANCELLED,
    ), outcome


def test_the_cli_started_before_the_server_waits_for_it_saying_so_once_and_gets_its_answer() -> None:
    server = ServerProcess()
    env = {k: v for k, v in os.environ.items() if k not in ("TOKENMILL_SERVER", "TOKENMILL_TOKEN")}
    # The default --max-retries: a normal start of the embedded model must be covered by it.
    cli = subprocess.Popen(
        [str(CLIENT), "--server", server.address, "generate", "-p", "Hello", "-l", "4"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        time.sleep(1.0)
        assert cli.poll() is None, cli.communicate()
        server.start()
        out, err = cli.communicate(timeout=120)
    finally:
        if cli.poll() is None:
            cli.kill()
            cli.wait()
        server.stop()
    assert cli.returncode == 0, err
    assert out.strip()
    waiting = [line for line in err.splitlines() if "waiting for the server" in line]
    assert len(waiting) == 1 and server.address in waiting[0], err
    assert "error" not in err


def test_a_port_already_taken_exits_1_naming_it_and_leaves_no_process_behind() -> None:
    """The workers start while the server reads its tokenizer and binds its ports; a server that then cannot
    listen must not leave them, nor the fork server they come from, behind."""
    import socket

    mark = uuid.uuid4().hex
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = ServerProcess(port=taken.getsockname()[1], env={"TOKENMILL_TEST_MARK": mark}).launch()
        assert server.proc is not None
        try:
            code = server.proc.wait(60)
        finally:
            server.stop()
    assert code == 1, server.logs()[-3000:]
    [refused] = log_events(server, "cannot_listen")
    assert refused["address"] == server.address
    deadline = time.monotonic() + 10
    while left_behind(mark) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left_behind(mark), server.logs()[-3000:]
