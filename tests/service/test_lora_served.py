"""LoRA adapters served (``--max-loras 5 --max-lora-rank 64 --lora-modules ...`` on a tiny random Llama, at
``--dtype float32 --quantization none``): through gRPC, an adapter's prompt logprobs are transformers + PEFT's;
a request with adapter X gives bitwise the same tokens and logprobs alone and among 15 others using four
other adapters and none; over HTTP, /v1/models lists the adapters with their parent, adapters load and
unload at run time behind the auth token, one that does not fit is refused naming the mismatch, one in use
is not unloaded, a request for one that is not loaded is not found, and a stream whose worker died resumes on
the restarted worker with its (run-time loaded) adapter. With ``--workers 2``, the router keeps each adapter's
requests on the worker already running that adapter."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.lora_adapters import make_adapter, peft_model, tiny_llama
from tests.server_process import ServerProcess
from tokenmill_client import AsyncClient, Client, NotFoundError

tokenizers = pytest.importorskip("tokenizers")
TOKEN = "lora-secret"
NAMES = ["x", "a", "b", "c", "d"]


def byte_tokenizer(directory: Path) -> None:
    """256 byte tokens and an EOS (257 ids), as tests/service/test_qwen3_served.py makes them."""
    alphabet = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.add_special_tokens(["<|eos|>"])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eos|>"}))


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("lora-served")
    base = tiny_llama(root / "base", vocab_size=257, max_position_embeddings=512)
    byte_tokenizer(root / "base")
    adapters = {
        name: make_adapter(base, root / name, rank, seed=20 + i)
        for i, (name, rank) in enumerate(zip(NAMES, [8, 64, 16, 4, 32]))
    }
    adapters["late"] = make_adapter(base, root / "late", 8, seed=30, targets=["q_proj", "down_proj"])
    other = tiny_llama(root / "other", vocab_size=257, intermediate_size=192)
    adapters["misfit"] = make_adapter(other, root / "misfit", 8, seed=31, targets=["gate_proj"])
    return {"root": root, "hf": base, "adapters": adapters}


@pytest.fixture(scope="module")
def server(made: dict[str, Any]) -> Iterator[ServerProcess]:
    modules = [f"{name}={made['adapters'][name]}" for name in NAMES]
    args = ["--model", str(made["root"] / "base"), "--dtype", "float32", "--quantization", "none"]
    args += ["--max-loras", "5", "--max-lora-rank", "64", "--lora-modules", *modules]
    args += ["--auth-token", TOKEN, "--drain-seconds", "1"]
    with ServerProcess(*args, metrics=True) as proc:
        yield proc


def client(server: ServerProcess) -> Client:
    return Client(server.address, timeout=120, token=TOKEN)


def http(server: ServerProcess, path: str, body: Any = None, token: str | None = TOKEN) -> tuple[int, Any]:
    headers = {"content-type": "application/json"}
    if token:
        headers["authorization"] = f"Bearer {token}"
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(server.http_url + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            raw = reply.read().decode()
            status = reply.status
    except urllib.error.HTTPError as err:
        raw, status = err.read().decode(), err.code
    try:
        return status, json.loads(raw)
    except json.JSONDecodeError:
        return status, raw


@torch.inference_mode()
def test_an_adapters_prompt_logprobs_are_transformers_plus_peft(server: ServerProcess, made: dict[str, Any]) -> None:
    with client(server) as c:
        (first, *_) = list(c.generate("Adapted, at last!", max_new_tokens=1, prompt_logprobs=True, adapter="a"))
        (base, *_) = list(c.generate("Adapted, at last!", max_new_tokens=1, prompt_logprobs=True))
    ids = [t.id for t in first.prompt_tokens]
    theirs = torch.log_softmax(peft_model(made["hf"], made["adapters"]["a"])(torch.tensor([ids])).logits[0], -1)
    plain = torch.log_softmax(made["hf"](torch.tensor([ids])).logits[0], -1)
    for row, (token, base_token) in enumerate(zip(first.prompt_tokens[1:], base.prompt_tokens[1:])):
        assert token.logprob is not None and abs(token.logprob - theirs[row, token.id].item()) < 1e-4
        assert base_token.logprob is not None and abs(base_token.logprob - plain[row, token.id].item()) < 1e-4


async def _generate(server: ServerProcess, prompt: str, adapter: str) -> list[tuple[int, float | None]]:
    async with AsyncClient(server.address, timeout=120, token=TOKEN) as c:
        events = [
            e async for e in c.generate(prompt, max_new_tokens=6, ignore_eos=True, logprobs=True, adapter=adapter)
        ]
    return [(t.id, t.logprob) for e in events for t in e.tokens]


def test_a_request_is_bitwise_the_same_alone_and_among_other_adapters(server: ServerProcess) -> None:
    prompt = "The same words, whoever is around."
    alone = asyncio.run(_generate(server, prompt, "x"))

    async def crowd() -> list[list[tuple[int, float | None]]]:
        others = [(f"Neighbour {i} says something else.", ["a", "b", "c", "d", ""][i % 5]) for i in range(15)]
        return await asyncio.gather(_generate(server, prompt, "x"), *(_generate(server, p, a) for p, a in others))

    together = asyncio.run(crowd())
    assert together[0] == alone
    assert len({tuple(t) for t in together[1:]}) > 1  # the neighbours did differ


def test_models_lists_the_adapters_with_their_parent(server: ServerProcess, made: dict[str, Any]) -> None:
    status, body = http(server, "/v1/models")
    assert status == 200
    base, *adapters = body["data"]
    assert base["parent"] is None
    assert {m["id"]: (m["parent"], m["root"]) for m in adapters} == {
        n: (base["id"], str(made["adapters"][n])) for n in NAMES
    }
    with client(server) as c:
        info = c.model_info()
    assert set(info.adapters) == set(NAMES) and info.limits.max_loras == 5 and info.limits.max_lora_rank == 64
    assert "lora" in info.load_plan and info.load_plan["executor"].startswith("native-stack")


def test_adapters_load_and_unload_at_run_time_over_http(server: ServerProcess, made: dict[str, Any]) -> None:
    path = str(made["adapters"]["late"])
    body = {"model": "late", "prompt": "Hello", "max_tokens": 3, "temperature": 0}
    assert http(server, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": path}, token=None)[0] == 401
    assert http(server, "/v1/completions", body)[0] == 404
    status, reply = http(server, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": path})
    assert status == 200 and "late" in reply
    status, reply = http(server, "/v1/completions", body)
    assert status == 200 and reply["model"] == "late" and reply["usage"]["completion_tokens"] == 3
    status, reply = http(server, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": path})
    assert status == 400 and "already loaded" in reply["error"]["message"]
    assert http(server, "/v1/unload_lora_adapter", {"lora_name": "late"})[0] == 200
    status, reply = http(server, "/v1/completions", body)
    assert status == 404 and reply["error"]["code"] == "model_not_found"
    status, reply = http(server, "/v1/unload_lora_adapter", {"lora_name": "late"})
    assert status == 404
    with client(server) as c, pytest.raises(NotFoundError, match="'late'"):
        list(c.generate("Hello", max_new_tokens=1, adapter="late"))


def test_an_adapter_that_does_not_fit_is_refused_naming_the_mismatch(
    server: ServerProcess, made: dict[str, Any]
) -> None:
    status, reply = http(
        server, "/v1/load_lora_adapter", {"lora_name": "misfit", "lora_path": str(made["adapters"]["misfit"])}
    )
    assert status == 400
    assert (
        "does not fit the base at model.layers.0.mlp.gate_proj: lora_A is [8, 128] and lora_B [192, 8]"
        in reply["error"]["message"]
    )
    status, reply = http(server, "/v1/load_lora_adapter", {"lora_name": "nothing", "lora_path": str(made["root"])})
    assert status == 400 and "is not a LoRA adapter" in reply["error"]["message"]
    assert "misfit" not in http(server, "/v1/models")[1]["data"]


def test_an_adapter_in_use_is_not_unloaded_and_its_request_is_unbroken(server: ServerProcess) -> None:
    with client(server) as c:
        stream = c.generate("Keep going", max_new_tokens=30, ignore_eos=True, adapter="b")
        first = next(stream)
        status, reply = http(server, "/v1/unload_lora_adapter", {"lora_name": "b"})
        assert status == 409 and "in use by 1 request" in reply["error"]["message"]
        rest = list(stream)
    assert len(first.tokens) + sum(len(e.tokens) for e in rest) == 30
    assert rest[-1].finish_reason is not None
    assert server.metric("tokenmill_lora_adapters_loaded") == len(NAMES)
    assert server.metric("vllm:lora_requests_info") is not None


def test_a_stream_resumed_after_its_worker_died_keeps_its_adapter(server: ServerProcess, made: dict[str, Any]) -> None:
    """The adapter is loaded at run time, so the restarted worker has it only because the router gave it."""
    import os
    import signal

    from tests.service.test_faults import worker_pids

    path = str(made["adapters"]["late"])
    assert http(server, "/v1/load_lora_adapter", {"lora_name": "runtime", "lora_path": path})[0] == 200
    with client(server) as c:
        expected = [
            t.id
            for e in c.generate("Resume me", max_new_tokens=24, ignore_eos=True, adapter="runtime")
            for t in e.tokens
        ]
        stream = c.generate("Resume me", max_new_tokens=24, ignore_eos=True, adapter="runtime")
        got = [t.id for t in next(stream).tokens]
        os.kill(worker_pids(server)[0], signal.SIGKILL)
        got += [t.id for e in stream for t in e.tokens]
        assert got == expected
        assert "runtime" in c.model_info().adapters
    assert '"request_resumed"' in server.logs()


@pytest.fixture(scope="module")
def two_workers(made: dict[str, Any]) -> Iterator[ServerProcess]:
    modules = [f"{name}={made['adapters'][name]}" for name in ("x", "b")]
    args = ["--model", str(made["root"] / "base"), "--workers", "2"]
    # --lora-modules alone, as vLLM's users start it: a slot for each adapter named (two here).
    args += ["--max-lora-rank", "16", "--lora-modules", *modules]
    with ServerProcess(*args) as proc:
        yield proc


def test_two_workers_each_run_one_adapters_requests(two_workers: ServerProcess) -> None:
    """``--workers 2``: requests on two adapters, each sent once the one before runs, in an order where
    load alone (ties taken in turn) would mix them, end up one adapter on each worker."""
    from tests.service.test_prefix_cache_across_workers import workers_of

    order = ["x", "b", "b", "x", "x", "b"]
    with Client(two_workers.address, timeout=120) as c:
        streams = []
        for i, adapter in enumerate(order):
            # Short prompts (no full KV block): no predicted prefix hit pulls a request anywhere.
            stream = c.generate(f"Q{i}", max_new_tokens=200, ignore_eos=True, adapter=adapter, request_id=f"ab{i}")
            next(stream)  # running (its first token is out) before the next is sent
            streams.append(stream)
        for stream in streams:
            assert sum(len(e.tokens) for e in stream) == 199
    worker = workers_of(two_workers, [f"ab{i}" for i in range(len(order))])
    by_adapter = {a: {worker[f"ab{i}"] for i, b in enumerate(order) if b == a} for a in ("x", "b")}
    assert len(by_adapter["x"]) == 1 and len(by_adapter["b"]) == 1 and by_adapter["x"] != by_adapter["b"]
