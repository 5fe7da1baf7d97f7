"""Prefix-aware routing inside one server (`--workers 2 --routing prefix`): requests sharing a long
prompt prefix go to the worker that cached it; unrelated requests still spread over both."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import grpc
import pytest

from tests.server_process import ServerProcess
from tokenmill_client._proto import generate_pb2 as pb
from tokenmill_client._proto import generate_pb2_grpc as pb_grpc

ONE_TOKEN = pb.StoppingParams(max_new_tokens=1, ignore_eos=True)
SYSTEM = " ".join(f"Rule {i}: answer briefly, politely and in plain words." for i in range(20))


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with ServerProcess("--workers", "2", "--routing", "prefix") as proc:
        yield proc


@pytest.fixture(scope="module")
def stub(server: ServerProcess) -> Iterator[pb_grpc.GenerationStub]:
    with grpc.insecure_channel(server.address) as channel:
        yield pb_grpc.GenerationStub(channel)


def workers_of(server: ServerProcess, request_ids: list[str]) -> dict[str, int]:
    """Which worker ran each request, from the server's request_finished log lines."""
    found = {}
    for line in server.logs().splitlines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if event.get("event") == "request_finished" and event.get("request_id") in request_ids:
            found[event["request_id"]] = event["worker_id"]
    assert set(found) == set(request_ids)
    return found


def run(stub: pb_grpc.GenerationStub, request_id: str, prompt: str) -> None:
    list(stub.Generate(pb.GenerateRequest(request_id=request_id, prompt=prompt, stopping=ONE_TOKEN), timeout=120))


def concurrently(stub: pb_grpc.GenerationStub, prompts: dict[str, str]) -> None:
    threads = [threading.Thread(target=run, args=(stub, request_id, prompt)) for request_id, prompt in prompts.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def test_requests_sharing_a_long_prefix_go_to_the_same_worker(
    server: ServerProcess, stub: pb_grpc.GenerationStub
) -> None:
    # At once, so that least-load would spread them: the prefix keeps them together.
    ids = [f"shared-{i}" for i in range(6)]
    concurrently(
        stub, {request_id: f"{SYSTEM}\nQuestion {i}: what is {i} plus {i}?" for i, request_id in enumerate(ids)}
    )
    assert len(set(workers_of(server, ids).values())) == 1


def test_unrelated_requests_still_spread_over_the_workers(server: ServerProcess, stub: pb_grpc.GenerationStub) -> None:
    sequential = [f"alone-{i}" for i in range(4)]
    for i, request_id in enumerate(sequential):
        run(stub, request_id, f"Topic {i * 7919}: tell me about the number {i * 104729}.")
    assert set(workers_of(server, sequential).values()) == {0, 1}
    together = [f"together-{i}" for i in range(6)]
    concurrently(
        stub, {request_id: f"Story {i}: once upon a time, a {i}-legged" for i, request_id in enumerate(together)}
    )
    assert set(workers_of(server, together).values()) == {0, 1}
