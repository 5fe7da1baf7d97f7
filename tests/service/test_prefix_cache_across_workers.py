"""The prefix cache across two workers of one server (`--workers 2 --routing prefix
--kv-events-endpoint tcp://*:PORT`): requests sharing a prompt prefix go to the worker that cached
it until it runs more than the other, unrelated requests spread over both, and each worker publishes what it stores in
and evicts from its cache as vLLM's KV events (ZMQ + msgpack), on the port plus its id."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import msgpack
import pytest
import zmq

from tests.server_process import ServerProcess, free_port
from tokenmill_client._proto import generate_pb2 as pb
from tokenmill_client._proto import generate_pb2_grpc as pb_grpc
from tokenmill_service.contract.block_hash import full_block_hashes

ONE_TOKEN = pb.StoppingParams(max_new_tokens=1, ignore_eos=True)
SYSTEM = " ".join(f"Rule {i}: answer briefly, politely and in plain words." for i in range(20))


def two_free_ports() -> int:
    """A port P with P + 1 free too (worker 1 publishes on P + 1)."""
    while True:
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port


@pytest.fixture(scope="module")
def kv_port() -> int:
    return two_free_ports()


@pytest.fixture(scope="module")
def subscribers(kv_port: int) -> Iterator[list[zmq.Socket[bytes]]]:
    """One subscriber per worker, connected before the server starts so that they hear its first batch."""
    sockets = []
    for worker in range(2):
        sub: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://127.0.0.1:{kv_port + worker}")
        sockets.append(sub)
    yield sockets
    for sub in sockets:
        sub.close(linger=0)


@pytest.fixture(scope="module")
def server(kv_port: int, subscribers: list[zmq.Socket[bytes]]) -> Iterator[ServerProcess]:
    with ServerProcess("--workers", "2", "--routing", "prefix", "--kv-events-endpoint", f"tcp://*:{kv_port}") as proc:
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


def test_requests_sharing_a_prefix_go_where_it_is_cached_until_that_worker_is_busier(
    server: ServerProcess, stub: pb_grpc.GenerationStub
) -> None:
    # One at a time (where least-load would take turns): each goes to the worker that cached the prefix.
    ids = [f"shared-{i}" for i in range(4)]
    for i, request_id in enumerate(ids):
        run(stub, request_id, f"{SYSTEM}\nQuestion {i}: what is {i} plus {i}?")
    assert len(set(workers_of(server, ids).values())) == 1
    # Eight at once: the worker holding it takes a request more than the other, not all eight; the other
    # caches the prefix too and the two share them.
    together = [f"shared-together-{i}" for i in range(8)]
    concurrently(
        stub, {request_id: f"{SYSTEM}\nQuestion {i}: what is {i} times {i}?" for i, request_id in enumerate(together)}
    )
    counts = [list(workers_of(server, together).values()).count(w) for w in (0, 1)]
    assert min(counts) >= 3, counts


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


class CacheView:
    """What one subscriber knows of a worker's cache, from its events alone."""

    def __init__(self) -> None:
        self.held: set[int] = set()
        self.batches: list[tuple[int, list[Any], int]] = []

    def read(self, sub: zmq.Socket[bytes], timeout_ms: int) -> bool:
        if not sub.poll(timeout_ms):
            return False
        topic, seq, payload = sub.recv_multipart()
        ts, events, rank = msgpack.unpackb(payload)
        assert topic == b"" and isinstance(ts, float)
        self.batches.append((int.from_bytes(seq, "big"), events, rank))
        for event in events:
            match event:
                case ["AllBlocksCleared"]:
                    self.held.clear()
                case ["BlockStored", hashes, _parent, tokens, 16, None, "CPU", None]:
                    assert len(tokens) == 16 * len(hashes)
                    self.held.update(hashes)
                case ["BlockRemoved", hashes, "CPU"]:
                    self.held.difference_update(hashes)
                case _:
                    raise AssertionError(f"not one of vLLM's KV events: {event!r}")
        return True


def test_each_worker_publishes_the_blocks_it_caches_as_vllm_kv_events(
    server: ServerProcess, stub: pb_grpc.GenerationStub, subscribers: list[zmq.Socket[bytes]]
) -> None:
    views = [CacheView(), CacheView()]
    ids = [1000 + (i * 7919) % 20000 for i in range(70)]  # four full blocks and a bit
    request_id = "kv-events"
    list(
        stub.Generate(
            pb.GenerateRequest(request_id=request_id, token_ids=pb.TokenIds(ids=ids), stopping=ONE_TOKEN), timeout=120
        )
    )
    worker = workers_of(server, [request_id])[request_id]
    wanted = set(full_block_hashes(ids, 16))
    deadline = time.monotonic() + 30
    while not wanted <= views[worker].held and time.monotonic() < deadline:
        for sub, view in zip(subscribers, views, strict=True):
            view.read(sub, 100)
    assert wanted <= views[worker].held
    for rank, view in enumerate(views):
        while view.read(subscribers[rank], 0):
            pass
        # Each worker's first batch says its cache starts empty; the sequence numbers count up from 0.
        assert view.batches[0][0] == 0 and view.batches[0][1][0] == ["AllBlocksCleared"]
        assert [b[0] for b in view.batches] == list(range(len(view.batches)))
        assert {b[2] for b in view.batches} == {rank}
    # The other worker never cached this prompt.
    assert not wanted & views[1 - worker].held
