"""Tensor-parallel replicas end to end: a real server with two replicas of three gloo ranks each.

The server runs the reference configuration (float32, unquantized) so that its tokens and
logprobs can be held to one rank's; the quantized default under tensor parallelism is checked in
test_tensor_parallel.py. Six processes of the embedded model on 2 CPU cores are slow, so the
token counts stay small.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from tests.server_process import ServerProcess
from tokenmill_client._proto import generate_pb2 as pb
from tokenmill_client._proto import generate_pb2_grpc as pb_grpc
from tokenmill_service.contract.request import GenerationRequest, RequestOutput, StoppingParams
from tokenmill_service.contract.tokenizer import load_tokenizer
from tokenmill_service.worker.engine.llm_engine import LLMEngine
from tokenmill_service.worker.loader import load_model, resolve_model_path

CHAT_TOKENS = 12  # greedy tokens compared on the reference chat


def generate(stub: pb_grpc.GenerationStub, timeout: float = 120, **kw: Any) -> list[pb.GenerateResponse]:
    return list(stub.Generate(pb.GenerateRequest(**kw), timeout=timeout))


def engine_outputs(engine: LLMEngine, request: GenerationRequest) -> list[RequestOutput]:
    engine.add_request(request)
    outs: list[RequestOutput] = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == request.request_id]
    return outs


@pytest.fixture(scope="module")
def two_replicas() -> Iterator[ServerProcess]:
    server = ServerProcess(
        "--workers",
        "2",
        "--tensor-parallel",
        "3",
        "--dtype",
        "float32",
        "--quantization",
        "none",
        "--heartbeat-timeout",
        "3",
        "--drain-seconds",
        "5",
    ).start(timeout=300)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def stub(two_replicas: ServerProcess) -> Iterator[pb_grpc.GenerationStub]:
    with grpc.insecure_channel(two_replicas.address) as channel:
        yield pb_grpc.GenerationStub(channel)


def test_three_ranks_in_float32_equal_one_rank(stub: pb_grpc.GenerationStub, reference: dict[str, Any]) -> None:
    # One rank, in this process, in the same reference configuration.
    path = resolve_model_path(None)
    engine = LLMEngine(load_model(path, quantization="none"), load_tokenizer(path))
    chat = reference["chat"][0]
    want = engine_outputs(
        engine, GenerationRequest("chat", chat["ids"], stopping=StoppingParams(max_new_tokens=CHAT_TOKENS))
    )
    msgs = generate(
        stub,
        chat=pb.Messages(messages=[pb.ChatMessage(**m) for m in chat["messages"]]),
        stopping=pb.StoppingParams(max_new_tokens=CHAT_TOKENS),
    )
    assert [t.id for m in msgs for t in m.tokens] == [t.id for o in want for t in o.tokens]

    ids = reference["prompt_logprobs"][0]["ids"]
    one = engine_outputs(
        engine, GenerationRequest("plp", ids, stopping=StoppingParams(max_new_tokens=1), prompt_logprobs=True)
    )[0].prompt_tokens
    three = generate(
        stub,
        token_ids=pb.TokenIds(ids=ids),
        stopping=pb.StoppingParams(max_new_tokens=1),
        prompt_logprobs=True,
    )[0].prompt_tokens
    assert one is not None and len(three) == len(one) == len(ids)
    assert max(abs(a.logprob - b.logprob) for a, b in zip(one[1:], three[1:])) <= 1e-4  # type: ignore[operator]

    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert info.tensor_parallel == 3 and info.num_workers == 2
    assert [[r.rank for r in w.ranks] for w in info.workers] == [[0, 1, 2], [0, 1, 2]]
    assert all(r.pid and r.device == "cpu" for w in info.workers for r in w.ranks)


def test_a_degree_that_does_not_split_the_heads_is_refused_at_start() -> None:
    server = ServerProcess("--tensor-parallel", "2")
    with pytest.raises(RuntimeError, match="exited with 2") as excinfo:
        server.start()
    assert "9 query heads, 3 key/value heads" in str(excinfo.value)
    assert "degrees that work: 1, 3" in str(excinfo.value)


def test_two_replicas_share_requests_and_survive_a_killed_rank(
    two_replicas: ServerProcess, stub: pb_grpc.GenerationStub
) -> None:
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert info.num_workers == 2 and [len(w.ranks) for w in info.workers] == [3, 3]
    victim = info.workers[0].ranks[1].pid

    started = threading.Barrier(5)
    results: list[tuple[int, str, list[float]]] = []  # (tokens, how it ended, when each message came)

    def one(i: int) -> None:
        tokens, ended, times = 0, "finished", []
        try:
            call = stub.Generate(
                pb.GenerateRequest(
                    prompt=f"Story {i}: once upon a time",
                    stopping=pb.StoppingParams(max_new_tokens=24, ignore_eos=True),
                ),
                timeout=120,
            )
            for msg in call:
                times.append(time.monotonic())
                if tokens == 0 and msg.tokens:
                    started.wait(60)
                tokens += len(msg.tokens)
        except grpc.RpcError as exc:
            ended = exc.code().name
        times.append(time.monotonic())
        results.append((tokens, ended, times))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    started.wait(120)  # every stream has its first token: both replicas are mid-stream
    running = [w.running for w in stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10).workers]
    assert running == [2, 2]  # the router spread the concurrent streams over both replicas
    killed_at = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    for t in threads:
        t.join(180)
    assert len(results) == 4
    # Each stream either moved to the other replica and finished, or ended UNAVAILABLE; none hung.
    assert all(ended in ("finished", "UNAVAILABLE") for _, ended, _ in results), results
    assert all(tokens == 24 for tokens, ended, _ in results if ended == "finished"), results
    assert sum(ended == "finished" for _, ended, _ in results) >= 2  # the other replica's streams
    # No stream waited long on the dead replica: each heard something (a token, its end) soon after.
    waits = [min(t for t in times if t > killed_at) - killed_at for _, _, times in results if times[-1] > killed_at]
    assert max(waits) < 20, waits

    assert '"worker_died"' in two_replicas.logs()

    # The whole replica is replaced: three new processes, serving again.
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
        if all(w.alive for w in info.workers) and info.workers[0].restarts == 1:
            break
        time.sleep(0.5)
    assert info.workers[0].restarts == 1 and all(w.alive for w in info.workers)
    assert victim not in {r.pid for r in info.workers[0].ranks}
    assert generate(stub, prompt="Hello", stopping=pb.StoppingParams(max_new_tokens=2))[-1].finish_reason
