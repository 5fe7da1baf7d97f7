"""Protocol-format tests of the llama-server peer driver (tokenmill-bench --peer llama-server=URL).

What is under test is our driver: the request it sends, and how it turns llama-server's streamed
``/completion`` answer into tokens, TTFT, inter-token latency and failures. llama.cpp itself is not
built here, so these tests serve its documented wire format from a small aiohttp server on loopback,
with known delays: ``data: {json}`` events, one per generated token carrying ``tokens_predicted``
(a token ending in an incomplete UTF-8 sequence is merged into the next event), a last event with
``"stop": true`` and ``timings``, ``data: {"error": ...}`` for an error in the stream. The real
server is exercised by running the benchmark against it (bench/README.md).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from tests.deploy.loopback_app import LoopbackApp
from tokenmill_bench.comparison import compare_levels, compare_long_prompts
from tokenmill_bench.llama_server import LlamaServer, completion_body
from tokenmill_bench.load import (
    LevelResult,
    RequestRecord,
    Target,
    merge_levels,
    prompt_ids,
    random_prompt_ids,
    run_in_turns,
    run_level,
)
from tokenmill_bench.report import format_tables

pytestmark = pytest.mark.protocol_format

BENCH = Path(sys.executable).parent / "tokenmill-bench"

TTFT_S = 0.15
GAP_S = 0.03


@dataclass
class Script:
    """How the fake server answers: its delays and the shape of its stream."""

    ttft_s: float = TTFT_S
    gap_s: float = GAP_S
    merge_at: set[int] = field(default_factory=set)
    """Tokens (1-based) whose event is held back and merged into the next one, as for incomplete UTF-8."""
    stop_after: int | None = None
    """Stop early (as if at end of sequence) after this many tokens."""
    error_after: int | None = None
    """Send an error event after this many tokens."""
    status: int = 200
    bodies: list[dict[str, Any]] = field(default_factory=list)
    peers: list[object] = field(default_factory=list)
    """The client address of each /completion request (one per connection)."""


SCRIPT = web.AppKey("script", Script)


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


async def completion(request: web.Request) -> web.StreamResponse:
    script: Script = request.app[SCRIPT]
    body = await request.json()
    script.bodies.append(body)
    script.peers.append(request.transport.get_extra_info("peername") if request.transport else None)
    if script.status != 200:
        return web.json_response({"error": {"code": script.status, "message": "bad request"}}, status=script.status)
    n = body["n_predict"]
    if script.stop_after is not None:
        n = min(n, script.stop_after)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)  # llama-server sends the headers once the slot starts (its "begin" result)
    await resp.write(b": keep-alive comment\n\n")
    await asyncio.sleep(script.ttft_s)
    for i in range(1, n + 1):
        if i > 1:
            await asyncio.sleep(script.gap_s)
        if script.error_after is not None and i > script.error_after:
            await resp.write(_event({"error": {"code": 500, "message": "slot crashed", "type": "server_error"}}))
            return resp
        if i in script.merge_at:
            continue
        await resp.write(
            _event(
                {
                    "index": 0,
                    "content": "x",
                    "tokens": [1000 + i],
                    "stop": False,
                    "id_slot": 0,
                    "tokens_predicted": i,
                    "tokens_evaluated": len(body["prompt"]),
                }
            )
        )
    final = {
        "index": 0,
        "content": "",
        "tokens": [],
        "stop": True,
        "tokens_predicted": n,
        "tokens_evaluated": len(body["prompt"]),
        "stop_type": "limit" if n == body["n_predict"] else "eos",
        "prompt": "a long text " * 2000,  # the real server repeats the prompt: the event exceeds 16 kB
        "timings": {"prompt_n": len(body["prompt"]), "prompt_ms": 12.5, "predicted_n": n, "predicted_ms": 99.0},
    }
    await resp.write(_event(final))
    return resp


async def props(request: web.Request) -> web.Response:
    return web.json_response(
        {
            "model_path": "/nowhere/model.gguf",
            "total_slots": 64,
            "build_info": "fake",
            "default_generation_settings": {},
        }
    )


class FakeLlamaServer:
    """The fake, on loopback in a thread of its own (so a benchmark subprocess can reach it too)."""

    def __init__(self) -> None:
        self.script = Script()
        app = web.Application()
        app[SCRIPT] = self.script
        app.router.add_post("/completion", completion)
        app.router.add_get("/props", props)
        self._app = LoopbackApp(app)

    @property
    def url(self) -> str:
        return self._app.url

    def start(self) -> FakeLlamaServer:
        self._app.start()
        return self

    def stop(self) -> None:
        self._app.stop()


@pytest.fixture
def fake() -> Iterator[FakeLlamaServer]:
    server = FakeLlamaServer().start()
    yield server
    server.stop()


def _run(coro_fn: Callable[[LlamaServer], Any], url: str) -> Any:
    async def scenario() -> Any:
        async with LlamaServer(url) as peer:
            return await coro_fn(peer)

    return asyncio.run(scenario())


def test_request_asks_for_the_same_tokens_tokenmill_gets(fake: FakeLlamaServer) -> None:
    ids = prompt_ids(12, 3, 49152)
    record = _run(lambda peer: peer.request(3, ids, 5, 10.0, "c1"), fake.url)
    assert record.error is None
    (body,) = fake.script.bodies
    assert body == completion_body(ids, 5)
    assert body["prompt"] == ids and body["n_predict"] == 5
    assert body["stream"] is True and body["ignore_eos"] is True
    assert body["temperature"] == 0.0 and body["top_k"] == 1  # greedy, as tokenmill's bench requests


def test_every_request_gets_a_connection_of_its_own(fake: FakeLlamaServer) -> None:
    """Regression: llama-server closes keep-alive connections left idle for 5 s (tokenmill's turn at a
    level is longer), and a reused one failed mid-write; so the bench never reuses one."""

    async def two_rounds(peer: LlamaServer) -> list[Any]:
        first = await asyncio.gather(*(peer.request(i, [1, 2], 2, 10.0, "c2") for i in range(2)))
        return [*first, *await asyncio.gather(*(peer.request(i, [1, 2], 2, 10.0, "c2") for i in range(2)))]

    records = _run(two_rounds, fake.url)
    assert all(r.error is None for r in records)
    assert len(fake.script.peers) == 4 and len(set(fake.script.peers)) == 4


def test_stream_is_counted_by_tokens_not_events(fake: FakeLlamaServer) -> None:
    # Token 3's event is merged into token 4's; token 6 (the last) arrives only with the final event.
    fake.script.merge_at = {3, 6}
    record = _run(lambda peer: peer.request(0, [1, 2, 3], 6, 10.0, "c1"), fake.url)
    assert record.error is None, record.error
    assert record.completion_tokens == 6
    assert record.counts == [1, 1, 2, 1, 1]
    assert record.finish_reason == "limit"
    assert record.server_ttft_ms == 12.5  # llama-server's own prompt time, from the final timings


def test_ttft_and_inter_token_latency_are_timed_on_arrival(fake: FakeLlamaServer) -> None:
    record = _run(lambda peer: peer.request(0, [1, 2, 3], 8, 10.0, "c1"), fake.url)
    assert record.error is None
    # Lower bounds the fake guarantees (it sleeps before each write; the client clock starts before sending),
    # loose upper bounds for a busy machine.
    assert record.ttft_s is not None and TTFT_S * 0.95 <= record.ttft_s < TTFT_S + 2.0
    assert record.arrivals[-1] - record.sent >= (TTFT_S + 7 * GAP_S) * 0.95
    gaps = record.inter_token_s()
    tokens, seconds = record.decode_span()
    assert len(gaps) == tokens == 7 and record.counts == [1] * 8
    assert sum(gaps) == pytest.approx(seconds) and 0 < seconds < 7 * GAP_S + 2.0


def test_failures_are_recorded_not_raised(fake: FakeLlamaServer) -> None:
    fake.script.error_after = 2
    record = _run(lambda peer: peer.request(0, [1], 5, 10.0, "c1"), fake.url)
    assert record.error == "SERVER: slot crashed" and record.completion_tokens == 2

    fake.script.error_after, fake.script.stop_after = None, 3
    record = _run(lambda peer: peer.request(0, [1], 5, 10.0, "c1"), fake.url)
    assert record.error == "SHORT: 3 of 5 tokens (stop_type=eos)"

    fake.script.status = 400
    record = _run(lambda peer: peer.request(0, [1], 5, 10.0, "c1"), fake.url)
    assert record.error is not None and record.error.startswith("HTTP 400")

    record = _run(lambda peer: peer.request(0, [1], 5, 10.0, "c1"), "http://127.0.0.1:9")  # nothing listens
    assert record.error is not None and "Connect" in record.error


def test_level_accounting_against_the_peer(fake: FakeLlamaServer) -> None:
    async def level(peer: LlamaServer) -> Any:
        return await run_level(
            peer,
            concurrency=4,
            num_requests=8,
            prompt_tokens=16,
            output_tokens=5,
            vocab_size=49152,
            shared_prompt=False,
            timeout=10.0,
            label="c4",
        )

    result = _run(level, fake.url)
    assert result.failed == 0 and result.generated_tokens == 40
    # Two rounds of four streams in step: each request takes TTFT + 4 gaps.
    assert result.wall_s >= 2 * (TTFT_S + 4 * GAP_S) * 0.9
    assert result.throughput_tok_s == pytest.approx(40 / result.wall_s)
    summary = result.summary()
    assert summary["ttft_ms"]["count"] == 8 and summary["ttft_ms"]["p50"] >= TTFT_S * 1000 * 0.95
    assert summary["itl_ms"]["count"] == 8 * 4
    sent = [body["prompt"] for body in fake.script.bodies]
    assert sorted(sent) == sorted(prompt_ids(16, i, 49152) for i in range(8))  # the prompts tokenmill gets


@dataclass
class InTurns:
    """A side that answers at once and notes, in a log it shares with the other side, who was asked when."""

    name: str
    log: list[tuple[str, int]]

    async def request(
        self, index: int, token_ids: list[int], output_tokens: int, timeout: float | None, label: str
    ) -> RequestRecord:
        self.log.append((self.name, index))
        now = time.perf_counter()
        return RequestRecord(index, now, [now + 0.001, now + 0.002], [1, output_tokens - 1], done=now + 0.002)


def test_one_stream_runs_a_request_a_side_in_turn_and_merges_each_sides_level() -> None:
    """The single stream alternates request by request (a shared machine's read rate moves within seconds),
    and each side's requests still make one level: all its records, its wall times added up."""
    log: list[tuple[str, int]] = []
    sides = [InTurns("tokenmill", log), InTurns("peer", log)]

    def one(target: Target, index: int) -> Awaitable[LevelResult]:
        return run_level(
            target, concurrency=1, num_requests=1, prompt_tokens=8, output_tokens=4, vocab_size=100,
            shared_prompt=False, timeout=5.0, label="c1", first_index=index,
        )  # fmt: skip

    levels = asyncio.run(run_in_turns(sides, 3, 10, one))
    assert log == [("tokenmill", 10), ("peer", 10), ("tokenmill", 11), ("peer", 11), ("tokenmill", 12), ("peer", 12)]
    for level in levels.values():
        assert [r.index for r in level.records] == [10, 11, 12] and level.generated_tokens == 12
        assert level.concurrency == 1 and 0 < level.wall_s < 1.0
        assert level.summary()["ttft_ms"]["count"] == 3
    with pytest.raises(ValueError):
        merge_levels([])


def _level(concurrency: int, tok_s: float, decode: float, ttft: float, itl: float) -> dict[str, Any]:
    return {
        "concurrency": concurrency,
        "throughput_tok_s": tok_s,
        "per_stream_decode_tok_s": decode,
        "ttft_ms": {"p50": ttft, "p99": 2 * ttft},
        "itl_ms": {"p50": itl, "p99": 2 * itl},
        "failed_requests": 0,
    }


def test_ratios_are_tokenmill_over_peer_and_bandwidth_counts_each_sides_bytes() -> None:
    (row,) = compare_levels(
        [_level(16, 300.0, 20.0, 100.0, 50.0)],
        [_level(16, 200.0, 12.5, 400.0, 80.0), _level(64, 1.0, 1.0, 1.0, 1.0)],
        weight_bytes=270_000_000,
        peer_weight_bytes=96_000_000,
        read_gbs=10.0,
    )
    assert row["ratio"]["throughput_tok_s"] == pytest.approx(1.5)
    assert row["ratio"]["ttft_ms_p50"] == pytest.approx(0.25)
    assert row["tokenmill"]["bandwidth_gbs"] == pytest.approx(0.27 * 20.0)
    assert row["peer"]["bandwidth_gbs"] == pytest.approx(0.096 * 12.5)
    assert row["tokenmill"]["bandwidth_share"] == pytest.approx(0.54)

    long = compare_long_prompts(
        [
            {"prompt_tokens": 1000, "ttft_ms": 1300.0, "error": None},
            {"prompt_tokens": 4000, "ttft_ms": 10400.0, "error": None},
        ],
        [
            {"prompt_tokens": 1000, "ttft_ms": 3200.0, "error": None},
            {"prompt_tokens": 4000, "ttft_ms": 16000.0, "error": None},
        ],
    )
    assert long["rows"][1]["ratio"] == pytest.approx(0.65)
    assert long["growth"]["tokenmill"] == pytest.approx(8.0) and long["growth"]["peer"] == pytest.approx(5.0)


def test_the_peers_bytes_a_token_count_the_experts_a_token_chooses(tmp_path: Path) -> None:
    import gguf
    import numpy as np

    from tokenmill_bench.model import gguf_tensor_bytes

    path = tmp_path / "moe.gguf"
    writer = gguf.GGUFWriter(str(path), "olmoe")
    writer.add_expert_count(4)
    writer.add_expert_used_count(2)
    writer.add_tensor("token_embd.weight", np.zeros((16, 8), dtype=np.float32))  # 512 bytes, read whole
    writer.add_tensor("blk.0.ffn_up_exps.weight", np.zeros((4, 8, 8), dtype=np.float32))  # 1024, half read
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert gguf_tensor_bytes(path) == 512 + 1024 * 2 // 4


def test_bench_prints_tokenmill_beside_the_peer(server_address: str, fake: FakeLlamaServer, tmp_path: Path) -> None:
    fake.script.ttft_s, fake.script.gap_s = 0.02, 0.005
    results = tmp_path / "results.json"
    args = ["--server", server_address, "--peer", f"llama-server={fake.url}", "--concurrency", "1,2"]
    args += ["--output-tokens", "6", "--prompt-tokens", "8", "--rounds", "1", "--min-requests", "1"]
    args += ["--warmup", "1", "--long-prompts", "20,40", "--copy-buffer-mib", "16", "--json", str(results), "--quiet"]
    proc = subprocess.run([str(BENCH), *args], check=False, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "tokenmill vs llama-server" in proc.stdout and "tokenmill/llama-server" in proc.stdout

    data = json.loads(results.read_text())
    peer, comparison = data["peer"], data["comparison"]
    assert peer["name"] == "llama-server" and peer["failed_requests"] == 0
    assert [level["concurrency"] for level in peer["levels"]] == [1, 2]
    assert all(level["generated_tokens"] == level["requests"] * 6 for level in peer["levels"])
    assert peer["weight_bytes"] is None and "not counted" in peer["weight_bytes_note"]  # /props names another file
    # Each side's single stream against the read rate measured right after it (the peer's bytes are not
    # counted here, so its share is unknown).
    beside = comparison["single_stream_beside"]
    assert beside["tokenmill"]["read_gbs"] > 0 and beside["peer"]["read_gbs"] > 0
    assert beside["tokenmill"]["share"] == pytest.approx(
        data["bandwidth_achieved_gbs"] / data["read_bandwidth_beside_single_gbs"]
    )
    assert beside["peer"]["share"] is None
    assert [row["concurrency"] for row in comparison["levels"]] == [1, 2]
    for row in comparison["levels"]:
        assert row["ratio"]["throughput_tok_s"] == pytest.approx(
            row["tokenmill"]["throughput_tok_s"] / row["peer"]["throughput_tok_s"]
        )
    assert [row["prompt_tokens"] for row in comparison["long_prompts"]["rows"]] == [20, 40]
    assert all(row["tokenmill_ttft_ms"] and row["peer_ttft_ms"] for row in comparison["long_prompts"]["rows"])
    first = comparison["first_request"]
    assert first["tokenmill"]["first_ttft_ms"] and first["peer"]["first_ttft_ms"] >= 20.0
    # Requests reached the fake as tokenmill's: warm-up, levels (1 + 2 requests), then the long prompts.
    lengths = [len(body["prompt"]) for body in fake.script.bodies]
    assert lengths == [8, 8, 8, 8, 20, 40]
    # Long prompts come from a seed drawn for this run (a llama-server slot kept from an earlier run
    # must not hold them), recorded in the results.
    seed = data["settings"]["long_prompt_seed"]
    vocab = data["model"]["vocab_size"]
    assert [body["prompt"] for body in fake.script.bodies[4:]] == [
        random_prompt_ids(n, seed=seed + n, vocab_size=vocab) for n in (20, 40)
    ]
    # So do the levels' prompts (a llama-server kept from an earlier run answered those from its slots' cache).
    prompt_seed = data["settings"]["prompt_seed"]
    assert sorted(body["prompt"] for body in fake.script.bodies[1:4]) == sorted(
        prompt_ids(8, i, vocab, seed=prompt_seed) for i in range(3)
    )
    assert format_tables(data) == proc.stdout.rstrip("\n")


def test_long_prompt_tries_are_fresh_prompts_in_turn_and_each_side_reports_its_median(
    server_address: str, fake: FakeLlamaServer, tmp_path: Path
) -> None:
    fake.script.ttft_s, fake.script.gap_s = 0.02, 0.005
    results = tmp_path / "results.json"
    args = ["--server", server_address, "--peer", f"llama-server={fake.url}", "--concurrency", "1"]
    args += ["--output-tokens", "2", "--prompt-tokens", "8", "--rounds", "1", "--min-requests", "1", "--warmup", "0"]
    args += ["--long-prompts", "20", "--long-prompt-tries", "3", "--copy-buffer-mib", "16", "--json", str(results)]
    proc = subprocess.run([str(BENCH), *args, "--quiet"], check=False, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "(median of 3)" in proc.stdout

    data = json.loads(results.read_text())
    assert data["settings"]["long_prompt_tries"] == 3
    # Three different prompts of 20 tokens reached the peer after the level's one request; the first is the
    # one a single try sends.
    prompts = [body["prompt"] for body in fake.script.bodies if len(body["prompt"]) == 20]
    seed, vocab = data["settings"]["long_prompt_seed"], data["model"]["vocab_size"]
    assert len(prompts) == 3 and len({tuple(p) for p in prompts}) == 3
    assert prompts[0] == random_prompt_ids(20, seed=seed + 20, vocab_size=vocab)
    for side in (data, data["peer"]):
        (row,) = side["long_prompts"]
        assert len(row["ttft_ms_each"]) == 3 and row["ttft_ms"] == sorted(row["ttft_ms_each"])[1]
    (compared,) = data["comparison"]["long_prompts"]["rows"]
    assert compared["tries"] == 3 and compared["peer_ttft_ms"] == data["peer"]["long_prompts"][0]["ttft_ms"]


def test_long_prompt_tries_below_one_are_refused() -> None:
    proc = subprocess.run([str(BENCH), "--long-prompt-tries", "0"], check=False, capture_output=True, text=True)
    assert proc.returncode == 2 and "--long-prompt-tries: must be at least 1" in proc.stderr
