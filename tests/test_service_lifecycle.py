"""One server through its life: metrics, auth, a full queue, a worker dying, SIGTERM draining.

The tests share one server and run in file order: the metrics check needs the first Generate,
and the drain test ends the server.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import openai
import pytest

from tests.server_process import ServerProcess, health_status
from tokenmill_client._proto import generate_pb2 as pb
from tokenmill_client._proto import generate_pb2_grpc as pb_grpc

TOKEN = "s3cret"
AUTH = [("authorization", f"Bearer {TOKEN}")]
LONG = pb.StoppingParams(max_new_tokens=400, ignore_eos=True)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    proc = ServerProcess(
        "--auth-token", TOKEN, "--max-batch-size", "1", "--max-queue", "1", "--drain-seconds", "30", metrics=True
    ).start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def stub(server: ServerProcess) -> Iterator[pb_grpc.GenerationStub]:
    with grpc.insecure_channel(server.address) as channel:
        yield pb_grpc.GenerationStub(channel)


def metric(server: ServerProcess, name: str) -> float | None:
    body = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    for line in body.splitlines():
        if line.startswith((name + " ", name + "{")):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_after_one_generate_the_ttft_histogram_counts_one(server: ServerProcess, stub: pb_grpc.GenerationStub) -> None:
    assert metric(server, "tokenmill_time_to_first_token_seconds_count") == 0
    list(stub.Generate(pb.GenerateRequest(prompt="Hello", stopping=pb.StoppingParams(max_new_tokens=3)), metadata=AUTH))
    assert metric(server, "tokenmill_time_to_first_token_seconds_count") == 1
    assert metric(server, "tokenmill_generated_tokens_total") == 3
    assert metric(server, 'tokenmill_requests_total{code="OK"}') == 1
    assert metric(server, "tokenmill_kv_blocks_total") is not None


def test_calls_without_the_bearer_token_are_unauthenticated(stub: pb_grpc.GenerationStub) -> None:
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(pb.GenerateRequest(prompt="Hello"), timeout=30))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as err:
        stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=[("authorization", "Bearer wrong")], timeout=30)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_health_needs_no_token(server: ServerProcess) -> None:
    assert health_status(server.address) == 1  # SERVING


def test_a_full_queue_is_resource_exhausted(stub: pb_grpc.GenerationStub) -> None:
    # One running (batch size 1) and one waiting (queue 1): the third call is refused at once.
    calls = [stub.Generate(pb.GenerateRequest(prompt="Go on", stopping=LONG), metadata=AUTH) for _ in range(2)]
    next(calls[0])  # running; the second waits behind it in the worker's queue
    time.sleep(0.5)
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(pb.GenerateRequest(prompt="One more"), metadata=AUTH, timeout=30))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "capacity" in err.value.details()
    for call in calls:
        call.cancel()


def test_http_calls_without_the_bearer_token_are_401(server: ServerProcess) -> None:
    with openai.OpenAI(base_url=server.http_url + "/v1", api_key="wrong", max_retries=0, timeout=60) as client:
        with pytest.raises(openai.AuthenticationError) as err:
            client.completions.create(model="tokenmill", prompt="Hello", max_tokens=1)
        assert err.value.status_code == 401 and "Authorization header" in err.value.message
        with pytest.raises(openai.AuthenticationError):
            client.models.list()
    # Probes need no token.
    assert urllib.request.urlopen(server.http_url + "/health", timeout=10).status == 200


def test_http_calls_beyond_the_queue_are_429(server: ServerProcess) -> None:
    # Batch size 1 and queue 1: of six concurrent calls two are admitted, the others refused at once.
    outcomes: list[str] = []

    def call() -> None:
        with openai.OpenAI(base_url=server.http_url + "/v1", api_key=TOKEN, max_retries=0, timeout=120) as client:
            try:
                stream = client.completions.create(
                    model="tokenmill", prompt="Go on", max_tokens=12, stream=True, extra_body={"ignore_eos": True}
                )
                outcomes.append(f"ok {sum(1 for _ in stream)}")
            except openai.RateLimitError as exc:
                assert exc.status_code == 429 and "capacity" in exc.message
                outcomes.append("429")

    threads = [threading.Thread(target=call) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert outcomes.count("429") >= 3 and any(o.startswith("ok") for o in outcomes), outcomes


def test_a_dying_worker_fails_its_calls_with_unavailable_and_is_restarted(
    server: ServerProcess, stub: pb_grpc.GenerationStub
) -> None:
    time.sleep(0.5)  # let the cancels above land
    call = stub.Generate(pb.GenerateRequest(prompt="Keep talking", stopping=LONG), metadata=AUTH, timeout=120)
    next(call)
    pids = [
        json.loads(line)["pid"] for line in server.logs().splitlines() if '"worker_ready"' in line and '"pid"' in line
    ]
    os.kill(pids[-1], signal.SIGKILL)
    with pytest.raises(grpc.RpcError) as err:
        list(call)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "worker 0 stopped" in err.value.details()
    # With its only worker gone the server reports NOT_SERVING, so probes route around it.
    deadline = time.monotonic() + 5
    while health_status(server.address) != 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert health_status(server.address) == 2
    # The server stayed up; the worker comes back and serves again.
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        info = stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=AUTH, timeout=10)
        if info.workers[0].alive and info.workers[0].restarts == 1:
            break
        time.sleep(0.5)
    else:
        pytest.fail("the worker was not restarted")
    deadline = time.monotonic() + 5
    while health_status(server.address) != 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert health_status(server.address) == 1
    msgs = list(
        stub.Generate(pb.GenerateRequest(prompt="Hi", stopping=pb.StoppingParams(max_new_tokens=2)), metadata=AUTH)
    )
    assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH


def test_sigterm_drains_in_flight_calls_refuses_new_ones_and_exits_zero(
    server: ServerProcess, stub: pb_grpc.GenerationStub
) -> None:
    results: dict[str, Any] = {}

    def in_flight() -> None:
        msgs = list(
            stub.Generate(
                pb.GenerateRequest(
                    prompt="Write a poem", stopping=pb.StoppingParams(max_new_tokens=300, ignore_eos=True)
                ),
                metadata=AUTH,
                timeout=120,
            )
        )
        results["finish"] = msgs[-1].finish_reason
        results["tokens"] = sum(len(m.tokens) for m in msgs)

    thread = threading.Thread(target=in_flight)
    thread.start()
    time.sleep(1.0)
    assert server.proc is not None
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    assert health_status(server.address) == 2  # NOT_SERVING while draining
    with pytest.raises(urllib.error.HTTPError) as http_err:  # and the HTTP port says so too
        urllib.request.urlopen(server.http_url + "/health", timeout=10)
    assert http_err.value.code == 503
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(pb.GenerateRequest(prompt="Too late"), metadata=AUTH, timeout=30))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    thread.join(120)
    assert results == {"finish": pb.FINISH_REASON_LENGTH, "tokens": 300}
    assert server.proc.wait(60) == 0
