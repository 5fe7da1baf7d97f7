"""One server through its life: metrics, auth, a full queue, a worker dying, SIGTERM draining.

The tests share one server but none depends on another having run: each waits until the server
is idle and serving before it starts, compares metrics before and after, and the drain test,
which ends its server, starts its own.
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

import anthropic
import grpc
import openai
import pytest

from tests.server_process import ServerProcess, health_status, reflected_services
from tokenmill_client._proto import generate_pb2 as pb
from tokenmill_client._proto import generate_pb2_grpc as pb_grpc

TOKEN = "s3cret"
AUTH = [("authorization", f"Bearer {TOKEN}")]
# Long enough to be still running when the test is done with it (then cancelled): 400 tokens, with speculative
# drafts kept, once ended within the test's half second and let a request in that should have been refused.
LONG = pb.StoppingParams(max_new_tokens=4000, ignore_eos=True)


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


@pytest.fixture(autouse=True)
def idle(stub: pb_grpc.GenerationStub) -> None:
    """Each test starts on a serving, idle server, whatever the tests before it left behind."""
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        info = stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=AUTH, timeout=10)
        if all(w.alive for w in info.workers) and info.engine.running == info.engine.waiting == 0:
            return
        time.sleep(0.2)
    pytest.fail("the server did not become idle and serving")


def test_one_generate_adds_one_to_the_ttft_histogram(server: ServerProcess, stub: pb_grpc.GenerationStub) -> None:
    names = ("tokenmill_time_to_first_token_seconds_count", "tokenmill_generated_tokens_total")
    ok = 'tokenmill_requests_total{code="OK"}'
    before = {name: server.metric(name) or 0.0 for name in (*names, ok)}
    list(stub.Generate(pb.GenerateRequest(prompt="Hello", stopping=pb.StoppingParams(max_new_tokens=3)), metadata=AUTH))
    assert server.metric(names[0]) == before[names[0]] + 1
    assert server.metric(names[1]) == before[names[1]] + 3
    assert server.metric(ok) == before[ok] + 1
    assert server.metric("tokenmill_kv_blocks_total") is not None


def test_calls_without_the_bearer_token_are_unauthenticated(stub: pb_grpc.GenerationStub) -> None:
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(pb.GenerateRequest(prompt="Hello"), timeout=30))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as err:
        stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=[("authorization", "Bearer wrong")], timeout=30)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_the_bearer_scheme_is_case_insensitive(server: ServerProcess, stub: pb_grpc.GenerationStub) -> None:
    # RFC 9110: "bearer" and "BEARER" name the scheme as "Bearer" does; another scheme with the token does not.
    for scheme in ("bearer", "BEARER", "Bearer"):
        stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=[("authorization", f"{scheme}  {TOKEN}")], timeout=30)
        with openai.OpenAI(base_url=server.http_url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
            client.models.list(extra_headers={"Authorization": f"{scheme} {TOKEN}"})
    with pytest.raises(grpc.RpcError) as err:
        stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=[("authorization", f"Basic {TOKEN}")], timeout=30)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_reflection_wants_the_bearer_token_too(server: ServerProcess) -> None:
    for version in ("v1", "v1alpha"):
        with pytest.raises(grpc.RpcError) as err:
            reflected_services(server.address, version)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED and "--auth-token" in str(err.value.details())
        assert "tokenmill.v1.Generation" in reflected_services(server.address, version, AUTH)


def test_a_token_set_means_no_warning_about_listening_without_one(server: ServerProcess) -> None:
    assert "listening_without_auth" not in server.logs()


def scrape(url: str, token: str | None) -> tuple[int, str, str | None]:
    """A /metrics scrape: status, body, WWW-Authenticate."""
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, reply.read().decode(), reply.headers.get("www-authenticate")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(), exc.headers.get("www-authenticate")


def test_metrics_on_either_port_want_the_bearer_token(server: ServerProcess) -> None:
    for url in (f"http://127.0.0.1:{server.metrics_port}/metrics", server.http_url + "/metrics"):
        for token in (None, "wrong"):
            status, _, scheme = scrape(url, token)
            assert (status, scheme) == (401, "Bearer"), url
        status, body, _ = scrape(url, TOKEN)
        assert status == 200 and "tokenmill_requests_total" in body, url


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


def test_the_messages_api_takes_the_token_as_x_api_key_or_bearer_and_refuses_in_its_shape(
    server: ServerProcess,
) -> None:
    ask: Any = {"model": "tokenmill", "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]}
    # The anthropic SDK sends api_key as x-api-key, auth_token as a bearer token (Claude Code's two settings).
    for key in ({"api_key": TOKEN}, {"auth_token": TOKEN}):
        with anthropic.Anthropic(base_url=server.http_url, max_retries=0, timeout=60, **key) as client:
            assert client.messages.create(**ask).usage.output_tokens == 1
            assert client.messages.count_tokens(model="tokenmill", messages=ask["messages"]).input_tokens > 0
    with anthropic.Anthropic(base_url=server.http_url, api_key="wrong", max_retries=0, timeout=60) as client:
        with pytest.raises(anthropic.AuthenticationError) as err:
            client.messages.create(**ask)
        body: Any = err.value.body
        assert err.value.status_code == 401 and body["type"] == "error"
        assert body["error"]["type"] == "authentication_error" and "x-api-key" in body["error"]["message"]
        assert err.value.response.headers["www-authenticate"] == "Bearer"
        with pytest.raises(anthropic.AuthenticationError) as err:
            client.messages.count_tokens(model="tokenmill", messages=ask["messages"])
        assert err.value.response.headers["www-authenticate"] == "Bearer"  # (as /openapi.json says every 401 has)
    # x-api-key is the Messages API's: the other routes want the bearer token.
    other = openai.OpenAI(base_url=server.http_url + "/v1", api_key="wrong", max_retries=0, timeout=60)
    with other, pytest.raises(openai.AuthenticationError):
        other.responses.create(model="tokenmill", input="Hi", extra_headers={"x-api-key": TOKEN})


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


def test_a_killed_worker_is_restarted_and_its_stream_continues_unbroken(
    server: ServerProcess, stub: pb_grpc.GenerationStub
) -> None:
    request = pb.GenerateRequest(prompt="Keep talking", stopping=pb.StoppingParams(max_new_tokens=24, ignore_eos=True))
    expected = [t.id for m in stub.Generate(request, metadata=AUTH, timeout=120) for t in m.tokens]
    call = stub.Generate(request, metadata=AUTH, timeout=300)
    first = next(call)
    pids = [
        json.loads(line)["pid"] for line in server.logs().splitlines() if '"worker_ready"' in line and '"pid"' in line
    ]
    os.kill(pids[-1], signal.SIGKILL)
    # With its only worker gone the server reports NOT_SERVING, so probes route around it.
    deadline = time.monotonic() + 5
    while health_status(server.address) != 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert health_status(server.address) == 2
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=AUTH, timeout=10)
    assert not info.workers[0].alive
    # The worker comes back, and the stream goes on where it was: nothing repeated, nothing lost.
    rest = list(call)
    got = [t.id for m in [first, *rest] for t in m.tokens]
    assert got == expected
    assert rest[-1].usage.completion_tokens == 24
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=AUTH, timeout=10)
    assert info.workers[0].alive and info.workers[0].restarts == 1
    assert health_status(server.address) == 1
    assert '"worker_died"' in server.logs() and '"request_resumed"' in server.logs()


def test_sigterm_drains_in_flight_calls_refuses_new_ones_and_exits_zero() -> None:
    server = ServerProcess("--auth-token", TOKEN, "--drain-seconds", "120").start()
    channel = grpc.insecure_channel(server.address)
    stub = pb_grpc.GenerationStub(channel)
    try:
        drain(server, stub)
    finally:
        channel.close()
        server.stop()


# Long enough to be still generating while the checks below run, at any decode speed: the drain
# test once raced a 60-token request that finished before the health check (at 25 ms a token).
DRAINED_TOKENS = 400


def drain(server: ServerProcess, stub: pb_grpc.GenerationStub) -> None:
    results: dict[str, Any] = {}
    streaming = threading.Event()

    def in_flight() -> None:
        msgs = []
        for msg in stub.Generate(
            pb.GenerateRequest(
                prompt="Write a poem", stopping=pb.StoppingParams(max_new_tokens=DRAINED_TOKENS, ignore_eos=True)
            ),
            metadata=AUTH,
            timeout=120,
        ):
            msgs.append(msg)
            streaming.set()
        results["finish"] = msgs[-1].finish_reason
        results["tokens"] = sum(len(m.tokens) for m in msgs)

    thread = threading.Thread(target=in_flight)
    thread.start()
    assert streaming.wait(60), "the in-flight request never started streaming"
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
    # One server with one replica: the refusal must not send the caller to "another replica" it does not have.
    assert "shutting down" in err.value.details() and "replica" not in err.value.details(), err.value.details()
    late = urllib.request.Request(
        server.http_url + "/v1/completions",
        data=json.dumps({"prompt": "Too late", "max_tokens": 4}).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"},
    )
    with pytest.raises(urllib.error.HTTPError) as http_late:
        urllib.request.urlopen(late, timeout=30)
    message = json.loads(http_late.value.read())["error"]["message"]
    assert http_late.value.code == 503 and "shutting down" in message and "replica" not in message, message
    thread.join(150)
    assert results == {"finish": pb.FINISH_REASON_LENGTH, "tokens": DRAINED_TOKENS}
    assert server.proc.wait(60) == 0
