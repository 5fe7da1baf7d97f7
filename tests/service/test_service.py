"""The gRPC service end to end: a real server on a loopback port, real workers, the real model."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.server_process import ServerProcess
from tokenmill_client._proto import generate_pb2 as pb
from tokenmill_client._proto import generate_pb2_grpc as pb_grpc

GRPCURL = Path(__file__).resolve().parents[2] / ".tools" / "bin" / "grpcurl"
FRANCE = pb.Messages(messages=[pb.ChatMessage(role="user", content="What is the capital of France?")])


@pytest.fixture(scope="module")
def stub(server_address: str) -> Iterator[pb_grpc.GenerationStub]:
    with grpc.insecure_channel(server_address) as channel:
        yield pb_grpc.GenerationStub(channel)


def generate(stub: pb_grpc.GenerationStub, **kw: Any) -> list[pb.GenerateResponse]:
    return list(stub.Generate(pb.GenerateRequest(**kw), timeout=120))


def grpcurl(*args: str) -> subprocess.CompletedProcess[str]:
    assert GRPCURL.exists(), "grpcurl is installed by `make tools` (scripts/install_tools.sh)"
    return subprocess.run([str(GRPCURL), *args], check=False, capture_output=True, text=True, timeout=120)


def log_events(server: ServerProcess) -> list[dict[str, Any]]:
    events = []
    for line in server.logs().splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return events


def wait_until(predicate: Any, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return bool(predicate())


# -- grpcurl: reflection, health, streaming ---------------------------------------------------


def test_grpcurl_lists_and_describes_the_services(server_address: str) -> None:
    listed = grpcurl("-plaintext", server_address, "list")
    assert listed.returncode == 0, listed.stderr
    assert "tokenmill.v1.Generation" in listed.stdout and "grpc.health.v1.Health" in listed.stdout
    described = grpcurl("-plaintext", server_address, "describe", "tokenmill.v1.Generation")
    assert described.returncode == 0 and "rpc Generate" in described.stdout


def test_grpcurl_chat_streams_paris_and_ends_with_a_finish_reason(server_address: str) -> None:
    body = json.dumps({"chat": {"messages": [{"role": "user", "content": "What is the capital of France?"}]}})
    result = grpcurl("-plaintext", "-d", body, server_address, "tokenmill.v1.Generation/Generate")
    assert result.returncode == 0, result.stderr
    decoder, text, messages, pos = json.JSONDecoder(), result.stdout, [], 0
    while pos < len(text.rstrip()):
        while text[pos].isspace():
            pos += 1
        obj, pos = decoder.raw_decode(text, pos)
        messages.append(obj)
    assert len(messages) > 2
    assert "Paris" in "".join(m.get("text", "") for m in messages)
    assert messages[-1]["finish_reason"] == "FINISH_REASON_EOS"
    assert all("finish_reason" not in m for m in messages[:-1])


def test_grpcurl_health_check_says_serving(server_address: str) -> None:
    result = grpcurl("-plaintext", server_address, "grpc.health.v1.Health/Check")
    assert result.returncode == 0 and '"SERVING"' in result.stdout


# -- correctness through the RPC ----------------------------------------------------------------


def test_the_default_configuration_is_faithful_to_the_reference_through_the_rpc(
    stub: pb_grpc.GenerationStub, reference: dict[str, Any]
) -> None:
    """The default server (the GGUF's blocks as stored, multiplied by the native VNNI kernel on
    16-bit fixed-point activations) stays close to the float32 reference: prompt token ids equal,
    logprobs within 1e-3 on average and 1e-2 at worst (measured: 4e-4 and 3.4e-3; the seams issue
    asks for 0.03 and 0.25 of a quantized default)."""
    errors = []
    for case in reference["prompt_logprobs"]:
        msgs = generate(
            stub,
            token_ids=pb.TokenIds(ids=case["ids"]),
            stopping=pb.StoppingParams(max_new_tokens=1),
            prompt_logprobs=True,
            top_logprobs=5,
        )
        prompt = msgs[0].prompt_tokens
        assert len(prompt) == len(case["ids"]) and not prompt[0].HasField("logprob")
        for tok, ref in zip(prompt[1:], case["positions"]):
            assert tok.id == ref["token"]
            errors.append(abs(tok.logprob - ref["logprob"]))
    assert sum(errors) / len(errors) <= 1e-3 and max(errors) <= 1e-2, (sum(errors) / len(errors), max(errors))


def test_default_greedy_chats_part_from_the_reference_only_at_near_ties(
    stub: pb_grpc.GenerationStub, reference: dict[str, Any]
) -> None:
    exact = 0
    for case in reference["chat"]:
        want = case["greedy_ids"]
        chat = pb.Messages(messages=[pb.ChatMessage(**m) for m in case["messages"]])
        msgs = generate(
            stub, chat=chat, stopping=pb.StoppingParams(max_new_tokens=len(want)), top_logprobs=2, prompt_logprobs=True
        )
        assert [t.id for t in msgs[0].prompt_tokens] == case["ids"]
        tokens = [t for m in msgs for t in m.tokens]
        got = [t.id for t in tokens]
        for pos, (g, w) in enumerate(zip(got, want)):
            if g != w:  # only acceptable where the served top two are within 0.15
                top = tokens[pos].top_logprobs
                assert top[0].logprob - top[1].logprob < 0.15, f"parts at {pos} without a near tie"
                break
        else:
            exact += got == want
        assert msgs[-1].usage.prompt_tokens == len(case["ids"])
        assert msgs[-1].usage.completion_tokens == len(got)
    assert exact >= len(reference["chat"]) / 2, f"{exact} of {len(reference['chat'])} chats match token for token"


def test_model_info_reports_the_default_quantization(stub: pb_grpc.GenerationStub) -> None:
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
    assert (info.quantization, info.dtype, info.backend) == ("gguf-vnni", "float32", "torch")


def test_responses_carry_usage_timing_and_the_callers_request_id(stub: pb_grpc.GenerationStub) -> None:
    msgs = generate(stub, prompt="Once upon a time", stopping=pb.StoppingParams(max_new_tokens=4), request_id="abc-1")
    assert all(m.request_id == "abc-1" for m in msgs)
    last = msgs[-1]
    assert last.finish_reason == pb.FINISH_REASON_LENGTH and last.usage.completion_tokens == 4
    assert 0 < last.timing.time_to_first_token_ms <= last.timing.total_ms
    assert last.timing.queue_ms >= 0


def test_x_request_id_metadata_becomes_the_request_id_in_responses_and_logs(
    server: ServerProcess, stub: pb_grpc.GenerationStub
) -> None:
    call = stub.Generate(
        pb.GenerateRequest(prompt="Hi", stopping=pb.StoppingParams(max_new_tokens=2)),
        metadata=[("x-request-id", "trace-42")],
        timeout=60,
    )
    assert {m.request_id for m in call} == {"trace-42"}
    assert wait_until(
        lambda: any(
            e.get("event") == "request_finished" and e.get("request_id") == "trace-42" for e in log_events(server)
        )
    )


def test_tokenize_and_model_info(stub: pb_grpc.GenerationStub, reference: dict[str, Any]) -> None:
    case = reference["tokenize"][0]
    reply = stub.Tokenize(pb.TokenizeRequest(text=case["text"]), timeout=30)
    assert list(reply.ids) == case["ids"] and "".join(reply.pieces) == case["text"]
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
    assert info.context_length > 0 and info.vocab_size == 49152 and info.num_workers == 1
    assert info.backend == "torch" and info.limits.max_new_tokens > 0
    assert info.engine.kv_blocks_total > 0 and len(info.workers) == 1 and info.workers[0].alive


# -- validation ---------------------------------------------------------------------------------

BAD_REQUESTS = [
    ({}, "input is missing"),
    ({"prompt": ""}, "prompt is empty"),
    ({"prompt": "x", "sampling": pb.SamplingParams(temperature=-1)}, "temperature must be >= 0"),
    ({"prompt": "x", "sampling": pb.SamplingParams(top_p=1.5)}, "top_p must be in [0, 1]"),
    ({"prompt": "x", "sampling": pb.SamplingParams(top_k=-3)}, "top_k must be >= 0"),
    ({"prompt": "x", "stopping": pb.StoppingParams(max_new_tokens=10**6)}, "max_new_tokens must be <= 4096"),
    ({"prompt": "x", "top_logprobs": 1000}, "top_logprobs must be <= 20"),
    ({"chat": pb.Messages(messages=[pb.ChatMessage(role="wizard", content="hi")])}, "wizard"),
    ({"token_ids": pb.TokenIds(ids=[1, 99999999])}, "outside the vocabulary"),
    ({"prompt": "x", "stopping": pb.StoppingParams(stop=["a"] * 17)}, "at most 16"),
    ({"prompt": "hello " * 5000, "stopping": pb.StoppingParams(max_new_tokens=4000)}, "8192"),
]


@pytest.mark.parametrize("fields,message", BAD_REQUESTS, ids=[m for _, m in BAD_REQUESTS])
def test_bad_input_is_invalid_argument_with_a_message(
    stub: pb_grpc.GenerationStub, fields: dict[str, Any], message: str
) -> None:
    with pytest.raises(grpc.RpcError) as err:
        generate(stub, **fields)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()


def test_prompt_beyond_the_context_names_both_numbers(stub: pb_grpc.GenerationStub) -> None:
    with pytest.raises(grpc.RpcError) as err:
        generate(stub, token_ids=pb.TokenIds(ids=[28] * 5000), stopping=pb.StoppingParams(max_new_tokens=4000))
    assert "given 5000 prompt tokens and max_new_tokens 4000" in err.value.details()


def test_the_server_keeps_serving_after_bad_input(stub: pb_grpc.GenerationStub) -> None:
    msgs = generate(stub, prompt="The sky is", stopping=pb.StoppingParams(max_new_tokens=3))
    assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH


# -- cancellation and deadlines -----------------------------------------------------------------


def engine_idle(stub: pb_grpc.GenerationStub) -> bool:
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    return info.engine.running == 0 and info.engine.waiting == 0 and info.engine.kv_blocks_used == 0


def test_cancelling_a_call_stops_its_sequence_in_the_worker(stub: pb_grpc.GenerationStub) -> None:
    call = stub.Generate(
        pb.GenerateRequest(
            prompt="Tell me a long story", stopping=pb.StoppingParams(max_new_tokens=2000, ignore_eos=True)
        ),
        timeout=120,
    )
    next(call)
    assert not engine_idle(stub)
    call.cancel()
    assert wait_until(lambda: engine_idle(stub), timeout=5), "the worker kept generating after the cancel"


def test_an_expired_deadline_is_deadline_exceeded_and_stops_the_sequence(stub: pb_grpc.GenerationStub) -> None:
    with pytest.raises(grpc.RpcError) as err:
        list(
            stub.Generate(
                pb.GenerateRequest(prompt="Count to a thousand", stopping=pb.StoppingParams(ignore_eos=True)),
                timeout=1.5,
            )
        )
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert wait_until(lambda: engine_idle(stub), timeout=5)


# -- several workers ----------------------------------------------------------------------------


def test_two_workers_each_initialize_torch_distributed_and_share_the_load() -> None:
    with ServerProcess("--workers", "2") as server, grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        results: list[list[pb.GenerateResponse]] = []

        def one(i: int) -> None:
            results.append(generate(stub, prompt=f"Fact number {i}:", stopping=pb.StoppingParams(max_new_tokens=8)))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert len(results) == 8 and all(r[-1].finish_reason == pb.FINISH_REASON_LENGTH for r in results)
        events = log_events(server)
        inits = [e for e in events if e.get("event") == "distributed_initialized"]
        assert sorted(e["worker_id"] for e in inits) == [0, 1]
        assert all(e["backend"] == "gloo" and e["world_size"] == 1 for e in inits)
        assert len({e["master_port"] for e in inits}) == 2  # each replica is its own process group
        # Each worker loads its tokenizer on a thread beside its weights; the line still names the worker.
        loaded = [e for e in events if e.get("event") == "tokenizer_loaded" and "worker_id" in e]
        assert sorted(e["worker_id"] for e in loaded) == [0, 1] and all(e["rank"] == 0 for e in loaded)
        dispatched = [e["worker_id"] for e in events if e.get("event") == "request_finished"]
        assert len(dispatched) == 8 and set(dispatched) == {0, 1}
        info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
        assert info.num_workers == 2 and all(w.alive for w in info.workers)
