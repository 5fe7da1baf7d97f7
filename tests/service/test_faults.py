"""Faults against a live server: fuzzed and malformed input, workers killed or stopped mid-stream.

Every stream must survive its worker: it moves to the other worker (or the restarted one) and the
caller sees one unbroken stream whose token ids and logprobs equal an uninterrupted run's, bit for
bit, greedy and seeded alike (numerics independent of batch and of prefill versus decode; random
draws keyed by seed and position).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.server_process import ServerProcess, health_status
from tokenmill_client._proto import generate_pb2 as pb
from tokenmill_client._proto import generate_pb2_grpc as pb_grpc

GENERATE = "/tokenmill.v1.Generation/Generate"
NEVER = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.DEADLINE_EXCEEDED}
FRANCE = pb.GenerateRequest(
    chat=pb.Messages(messages=[pb.ChatMessage(role="user", content="What is the capital of France?")]),
    stopping=pb.StoppingParams(max_new_tokens=16),
)

# -- fuzzing -----------------------------------------------------------------------------------

floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True, width=32),
    st.sampled_from([0.0, 1e-45, 1e-38, 1e-4, 0.5, 1.0, 2.0, -1.0]),
)
texts = st.text(max_size=40)
messages = st.lists(
    st.builds(pb.ChatMessage, role=st.sampled_from(["system", "user", "assistant", "tool", ""]), content=texts),
    max_size=4,
).map(lambda m: pb.Messages(messages=m))
token_ids = st.lists(st.integers(0, 2**32 - 1) | st.integers(0, 49151), max_size=12)


@st.composite
def requests(draw: st.DrawFn) -> bytes:
    r = pb.GenerateRequest()
    which = draw(st.sampled_from(["prompt", "chat", "token_ids", None]))
    if which == "prompt":
        r.prompt = draw(texts)
    elif which == "chat":
        r.chat.CopyFrom(draw(messages))
    elif which == "token_ids":
        r.token_ids.ids.extend(draw(token_ids))
    if draw(st.booleans()):
        s = r.sampling
        s.temperature, s.top_p, s.repetition_penalty = draw(floats), draw(floats), draw(floats)
        s.top_k = draw(st.integers(-(2**31), 2**31 - 1) | st.integers(-2, 60))
        if draw(st.booleans()):
            s.seed = draw(st.integers(0, 2**64 - 1))
    # Short generations keep 5,000 requests fast; 0 (until EOS) and the big ones must be refused or bounded.
    r.stopping.max_new_tokens = draw(st.sampled_from([1, 2, 3, 4097, 2**32 - 1]))
    r.stopping.stop.extend(draw(st.lists(st.text(max_size=300), max_size=3)))
    r.stopping.stop_token_ids.extend(draw(st.lists(st.integers(0, 2**32 - 1), max_size=3)))
    r.stopping.ignore_eos = draw(st.booleans())
    r.logprobs, r.prompt_logprobs = draw(st.booleans()), draw(st.booleans())
    r.top_logprobs = draw(st.integers(0, 25) | st.integers(0, 2**32 - 1))
    r.request_id = draw(st.text(max_size=200))
    return r.SerializeToString()


def collect(strategy: st.SearchStrategy[bytes], n: int) -> list[bytes]:
    """Draw `n` examples with a fixed seed (derandomized), without shrinking."""
    out: list[bytes] = []

    @settings(
        max_examples=n,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def draw(example: bytes) -> None:
        out.append(example)

    draw()
    return out


async def send_all(address: str, payloads: list[bytes], concurrency: int = 64) -> dict[str, int]:
    """Send raw payloads as Generate calls; an answer is an error status or a first message."""
    codes: dict[str, int] = {}
    gate = asyncio.Semaphore(concurrency)
    async with grpc.aio.insecure_channel(address) as channel:
        generate = channel.unary_stream(GENERATE, request_serializer=None, response_deserializer=None)

        async def one(payload: bytes) -> None:
            async with gate:
                call = generate(payload, timeout=60)
                try:
                    async for _ in call:
                        call.cancel()  # answered: the rest of the stream is not what is under test
                        break
                    code = "OK"
                except grpc.aio.AioRpcError as err:
                    code = err.code().name
                    assert err.code() not in NEVER, (payload, err.code(), err.details())
                codes[code] = codes.get(code, 0) + 1

        await asyncio.gather(*(one(p) for p in payloads))
    return codes


def test_fuzzed_requests_and_random_bytes_get_a_status_never_unknown_or_internal(server: ServerProcess) -> None:
    # (1,500 here to keep the suite's time; bench/fuzz_grpc.py sends 5,000 of a wider generator.)
    fuzzed = collect(requests(), 1500)
    raw = collect(st.binary(max_size=120), 300)
    codes = asyncio.run(send_all(server.address, fuzzed + raw))
    assert sum(codes.values()) == 1800
    assert codes.get("INVALID_ARGUMENT", 0) > 0 and codes.get("OK", 0) > 0, codes
    # The server still answers a normal chat correctly.
    with grpc.insecure_channel(server.address) as channel:
        msgs = list(pb_grpc.GenerationStub(channel).Generate(FRANCE, timeout=60))
    assert "Paris" in "".join(m.text for m in msgs)


def test_bytes_that_are_not_a_request_are_invalid_argument_with_a_precise_message(server: ServerProcess) -> None:
    with grpc.insecure_channel(server.address) as channel:
        generate = channel.unary_stream(GENERATE, request_serializer=None, response_deserializer=None)
        for payload in (b"\x0a\x02\xff\xfe", b"\xff\xff\xff\xff", b"\x12\x05\x0a"):
            with pytest.raises(grpc.RpcError) as err:
                list(generate(payload, timeout=30))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details().startswith("the request is not a valid tokenmill.v1.GenerateRequest: ")


def test_tool_parameters_nested_past_what_json_reads_are_invalid_argument(server: ServerProcess) -> None:
    # (json.loads raised RecursionError, which ended the call with UNKNOWN; bench/fuzz_grpc.py found it.)
    request = pb.GenerateRequest(
        chat=FRANCE.chat, tools=[pb.Tool(name="add", parameters="[" * 5000 + "]" * 5000)], stopping=FRANCE.stopping
    )
    with grpc.insecure_channel(server.address) as channel, pytest.raises(grpc.RpcError) as err:
        list(pb_grpc.GenerationStub(channel).Generate(request, timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == "tools[0].parameters is nested too deeply"


def test_a_denormal_temperature_is_greedy_and_long_request_ids_are_refused(server: ServerProcess) -> None:
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        greedy = [t.id for m in stub.Generate(FRANCE, timeout=60) for t in m.tokens]
        tiny = pb.GenerateRequest()
        tiny.CopyFrom(FRANCE)
        tiny.sampling.temperature = 1e-45
        assert [t.id for m in stub.Generate(tiny, timeout=60) for t in m.tokens] == greedy
        long_id = pb.GenerateRequest(prompt="Hi", request_id="x" * 129)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(long_id, timeout=30))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in err.value.details()
        limits = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30).limits
        assert limits.max_request_id_length == 128 and limits.min_temperature == pytest.approx(1e-3)
        assert limits.max_resumptions == 2


# -- workers killed and stopped ------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_workers() -> Iterator[ServerProcess]:
    # The default configuration (the GGUF's blocks, float32 activations), two replicas.
    proc = ServerProcess("--workers", "2", "--heartbeat-timeout", "2", "--drain-seconds", "5").start(timeout=300)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def one_worker() -> Iterator[ServerProcess]:
    proc = ServerProcess("--heartbeat-timeout", "2", "--drain-seconds", "5").start(timeout=300)
    yield proc
    proc.stop()


def worker_pids(server: ServerProcess) -> dict[int, int]:
    """worker_id -> pid of its latest process, from the workers' own `worker_ready` lines."""
    pids: dict[int, int] = {}
    for line in server.logs().splitlines():
        if '"worker_ready"' in line and '"kv_blocks"' in line:
            event = json.loads(line)
            pids[event["worker_id"]] = event["pid"]
    return pids


def wait_serving(server: ServerProcess, workers: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        while time.monotonic() < deadline:
            info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
            if sum(w.alive for w in info.workers) == workers and info.engine.running + info.engine.waiting == 0:
                return
            time.sleep(0.2)
    pytest.fail(f"{workers} workers were not serving within {timeout} s")


def streams(n_greedy: int, n_seeded: int, max_new_tokens: int) -> list[pb.GenerateRequest]:
    out = []
    for i in range(n_greedy + n_seeded):
        r = pb.GenerateRequest(
            prompt=f"Story number {i}: once upon a time",
            stopping=pb.StoppingParams(max_new_tokens=max_new_tokens, ignore_eos=True),
            logprobs=True,
        )
        if i >= n_greedy:
            r.sampling.temperature, r.sampling.seed = 0.8, 1000 + i
        out.append(r)
    return out


async def run_streams(
    address: str, reqs: list[pb.GenerateRequest], fault: Any = None, after: int = 0
) -> list[tuple[list[int], list[float], int]]:
    """Run every request concurrently; call `fault()` once `after` streams (default: all) have their
    first message."""
    after = after or len(reqs)
    started = 0
    all_started = asyncio.Event()
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationStub(channel)

        async def one(r: pb.GenerateRequest) -> tuple[list[int], list[float], int]:
            nonlocal started
            ids: list[int] = []
            lps: list[float] = []
            usage = -1
            first = True
            async for m in stub.Generate(r, timeout=600):
                ids += [t.id for t in m.tokens]
                lps += [t.logprob for t in m.tokens]
                if m.finish_reason:
                    usage = m.usage.completion_tokens
                if first:
                    first, started = False, started + 1
                    if started == after:
                        all_started.set()
            return ids, lps, usage

        tasks = [asyncio.ensure_future(one(r)) for r in reqs]
        if fault is not None:
            await asyncio.wait_for(all_started.wait(), 300)
            await fault()
        return list(await asyncio.gather(*tasks))


def compare(expected: list[Any], got: list[Any], n_greedy: int) -> None:
    for i, ((ids, lps, usage), (want_ids, want_lps, _)) in enumerate(zip(got, expected)):
        assert usage == len(ids), f"stream {i}: usage {usage} but {len(ids)} tokens"
        kind = "greedy" if i < n_greedy else "seeded"
        assert ids == want_ids, f"{kind} stream {i}: token ids differ"
        assert lps == want_lps, f"{kind} stream {i}: logprobs differ"


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP])
def test_streams_of_a_killed_or_stopped_worker_move_to_the_other_and_complete_unchanged(
    two_workers: ServerProcess, sig: signal.Signals
) -> None:
    wait_serving(two_workers, 2)
    reqs = streams(8, 8, max_new_tokens=24)
    expected = asyncio.run(run_streams(two_workers.address, reqs))
    victim = worker_pids(two_workers)[0]
    hit_at: list[float] = []

    async def fault() -> None:
        os.kill(victim, sig)
        hit_at.append(time.monotonic())

    got = asyncio.run(run_streams(two_workers.address, reqs, fault))
    if sig == signal.SIGSTOP:
        died = [json.loads(line) for line in two_workers.logs().splitlines() if '"worker_died"' in line]
        assert "no heartbeat" in died[-1]["reason"]
    compare(expected, got, n_greedy=8)


def test_streams_of_the_only_worker_wait_for_its_restart_and_complete_unchanged(one_worker: ServerProcess) -> None:
    wait_serving(one_worker, 1)
    reqs = streams(8, 8, max_new_tokens=24)
    expected = asyncio.run(run_streams(one_worker.address, reqs))

    async def fault() -> None:
        os.kill(worker_pids(one_worker)[0], signal.SIGKILL)

    got = asyncio.run(run_streams(one_worker.address, reqs, fault))
    compare(expected, got, n_greedy=8)


def parent_of(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))


@pytest.mark.skipif(sys.platform != "linux", reason="workers are forked from a fork server on Linux only")
def test_a_worker_and_its_restart_are_forks_of_the_servers_fork_server(one_worker: ServerProcess) -> None:
    """A restart imports nothing again (no torch: seconds): like the first worker, it is forked from the fork
    server that the server process started."""
    assert one_worker.proc is not None
    wait_serving(one_worker, 1)
    first = worker_pids(one_worker)[0]
    fork_server = parent_of(first)
    assert parent_of(fork_server) == one_worker.proc.pid
    assert b"multiprocessing.forkserver" in Path(f"/proc/{fork_server}/cmdline").read_bytes()
    os.kill(first, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while worker_pids(one_worker)[0] == first and time.monotonic() < deadline:
        time.sleep(0.1)
    restarted = worker_pids(one_worker)[0]
    assert restarted != first and parent_of(restarted) == fork_server
    wait_serving(one_worker, 1)


def test_constrained_streams_of_a_killed_worker_replay_their_grammar_and_complete_unchanged(
    two_workers: ServerProcess,
) -> None:
    wait_serving(two_workers, 2)
    item = {
        "type": "object",
        "properties": {"word": {"type": "string", "maxLength": 12}, "n": {"type": "integer"}},
        "required": ["word", "n"],
        "additionalProperties": False,
    }
    schema = json.dumps({"type": "array", "items": item, "minItems": 5, "maxItems": 8})
    reqs = streams(4, 4, max_new_tokens=48)
    for r in reqs:
        r.json_schema = schema
        r.stopping.ignore_eos = False
    expected = asyncio.run(run_streams(two_workers.address, reqs))
    resumed_before = two_workers.logs().count('"request_resumed"')

    async def fault() -> None:
        os.kill(worker_pids(two_workers)[0], signal.SIGKILL)

    got = asyncio.run(run_streams(two_workers.address, reqs, fault))
    assert two_workers.logs().count('"request_resumed"') > resumed_before
    compare(expected, got, n_greedy=4)


def test_256_streams_survive_two_worker_kills(two_workers: ServerProcess) -> None:
    wait_serving(two_workers, 2)
    reqs = streams(256, 0, max_new_tokens=8)
    for r in reqs:
        r.logprobs = False

    async def fault() -> None:
        # Both workers die: the streams wait (parked) for the first restarted one, then go on.
        pids = worker_pids(two_workers)
        os.kill(pids[0], signal.SIGKILL)
        await asyncio.sleep(0.3)
        os.kill(pids[1], signal.SIGKILL)

    got = asyncio.run(run_streams(two_workers.address, reqs, fault, after=32))
    assert len(got) == 256
    for ids, _, usage in got:
        assert len(ids) == usage == 8
    assert health_status(two_workers.address) == 1


def test_a_held_up_server_process_does_not_declare_its_healthy_workers_dead() -> None:
    # The server process (router and front) stopped for twice --heartbeat-timeout while its workers go on:
    # their heartbeats wait unread in the pipes. Once it runs again it must read them, not restart the workers
    # (a front stalled by a 10 MB prompt once did: 33 s to recover).
    with ServerProcess("--heartbeat-timeout", "1.5", "--drain-seconds", "2") as proc:
        assert proc.proc is not None
        os.kill(proc.proc.pid, signal.SIGSTOP)
        time.sleep(3.5)
        os.kill(proc.proc.pid, signal.SIGCONT)
        time.sleep(2.0)  # a few of the supervisor's rounds
        with grpc.insecure_channel(proc.address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            request = pb.GenerateRequest(prompt="Hello", stopping=pb.StoppingParams(max_new_tokens=2))
            assert list(stub.Generate(request, timeout=60))[-1].finish_reason
        assert '"worker_died"' not in proc.logs(), [x for x in proc.logs().splitlines() if "worker_died" in x]
