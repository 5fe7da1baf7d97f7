"""Protocol-format tests of ``tokenmill-bench structured`` (JSON-schema output, tokenmill beside llama-server).

What is under test is the bench: the request it sends to both servers, and how it judges and counts their
answers. llama.cpp is not built here, so the answers come from a small aiohttp server on loopback speaking
the OpenAI chat route as llama-server documents it (tools/server/README.md: ``response_format``
``{"type": "json_schema", "json_schema": {"schema": ...}}``; a non-stream answer with ``choices``, ``usage``
and llama-server's own ``timings``; an error as ``{"error": {"code", "message", "type"}}``), scripted per
schema: valid, breaking the schema, cut short, refused. The real servers are measured by running the
bench against them (bench/README.md).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from aiohttp import web

from tests.deploy.loopback_app import LoopbackApp
from tokenmill_bench.cli import main as bench_main
from tokenmill_bench.structured import DEFAULT_SCHEMAS, SchemaCase, chat_body, judge, load_cases

pytestmark = pytest.mark.protocol_format

PERSON = SchemaCase(
    "person",
    "A person?",
    {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
)
ANSWERS: dict[str, tuple[int, Any]] = {
    # schema name -> (HTTP status, the message content, or the error body)
    "valid": (200, '{"name": "Ada", "age": 36}'),
    "breaks": (200, '{"name": "Ada", "age": -1}'),
    "cut": (200, '{"name": "Ad'),
    "refused": (
        400,
        {"error": {"code": 400, "message": "JSON schema conversion failed", "type": "invalid_request_error"}},
    ),
}
TOKENS = 7


@dataclass
class Fake:
    bodies: list[dict[str, Any]] = field(default_factory=list)
    in_flight: int = 0
    most_in_flight: int = 0


FAKE = web.AppKey("fake", Fake)


async def chat(request: web.Request) -> web.Response:
    fake = request.app[FAKE]
    body = await request.json()
    fake.bodies.append(body)
    fake.in_flight += 1
    fake.most_in_flight = max(fake.most_in_flight, fake.in_flight)
    try:
        await asyncio.sleep(0.02)
    finally:
        fake.in_flight -= 1
    status, answer = ANSWERS[body["response_format"]["json_schema"]["name"]]
    if status != 200:
        return web.json_response(answer, status=status)
    return web.json_response(
        {
            "object": "chat.completion",
            "model": "fake.gguf",
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "length" if answer.endswith('"Ad') else "stop",
                    "message": {"role": "assistant", "content": answer},
                }
            ],
            "usage": {"prompt_tokens": 11, "completion_tokens": TOKENS, "total_tokens": 11 + TOKENS},
            "timings": {"predicted_n": TOKENS, "predicted_per_second": 50.0},
        }
    )


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "fake.gguf", "object": "model"}]})


class FakeServer:
    """The stand-in on loopback."""

    def __init__(self) -> None:
        self.fake = Fake()
        app = web.Application()
        app[FAKE] = self.fake
        app.router.add_post("/v1/chat/completions", chat)
        app.router.add_get("/v1/models", models)
        self._app = LoopbackApp(app)

    @property
    def url(self) -> str:
        return self._app.url

    def start(self) -> FakeServer:
        self._app.start()
        return self

    def stop(self) -> None:
        self._app.stop()


@pytest.fixture
def fake() -> Iterator[FakeServer]:
    server = FakeServer().start()
    yield server
    server.stop()


def test_the_request_is_openai_json_schema_output_as_llama_server_reads_it() -> None:
    body = chat_body(PERSON, 64, "m")
    assert body["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": PERSON.schema, "strict": True},
    }
    assert body["messages"] == [{"role": "user", "content": "A person?"}]
    assert body["max_tokens"] == 64 and body["temperature"] == 0.0 and body["model"] == "m"


def _answer(content: str, finish: str = "stop") -> dict[str, Any]:
    return {
        "choices": [{"finish_reason": finish, "message": {"content": content}}],
        "usage": {"completion_tokens": 5},
    }


def test_answers_are_judged_valid_invalid_or_failed() -> None:
    ok = judge(PERSON, 200, _answer('{"name": "Ada", "age": 36}'), 0.5)
    assert ok.valid and ok.completion_tokens == 5 and ok.problem is None and ok.error is None
    breaks = judge(PERSON, 200, _answer('{"name": "Ada"}'), 0.5)
    assert not breaks.valid and breaks.problem is not None and breaks.problem.startswith("schema: ")
    assert "'age' is a required property" in breaks.problem
    cut = judge(PERSON, 200, _answer('{"name": "A', "length"), 0.5)
    assert not cut.valid and cut.problem is not None and cut.problem.startswith("json: ") and "length" in cut.problem
    refused = judge(PERSON, 400, {"error": {"code": 400, "message": "unsupported keyword"}}, 0.1)
    assert refused.error == "HTTP 400: unsupported keyword" and not refused.valid
    assert judge(PERSON, 502, "Bad Gateway", 0.1).error == "HTTP 502: Bad Gateway"


def test_the_builtin_schemas_are_valid_schemas_and_a_file_replaces_them(tmp_path: Path) -> None:
    cases = load_cases(None)
    assert [c.name for c in cases] == [s["name"] for s in DEFAULT_SCHEMAS] and len(cases) >= 5
    for case in cases:
        jsonschema.Draft202012Validator.check_schema(case.schema)
    path = tmp_path / "schemas.json"
    path.write_text(json.dumps([{"name": "p", "prompt": "A person?", "schema": PERSON.schema}]))
    assert load_cases(path) == [SchemaCase("p", "A person?", PERSON.schema)]
    path.write_text(json.dumps([{"name": "bad", "schema": {"type": 12}}]))
    with pytest.raises(jsonschema.SchemaError):
        load_cases(path)


def test_both_sides_are_measured_alike_and_counted_by_their_answers(
    fake: FakeServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    schemas = tmp_path / "schemas.json"
    schemas.write_text(json.dumps([{"name": n, "prompt": f"{n}?", "schema": PERSON.schema} for n in ANSWERS]))
    out = tmp_path / "results.json"
    args = ["--schemas", str(schemas), "--requests", "40", "--concurrency", "16", "--max-tokens", "32"]
    code = bench_main(["structured", "--tokenmill", fake.url, "--llama-server", fake.url, *args, "--json", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    tokenmill, llama = result["servers"]
    assert (tokenmill["server"], llama["server"]) == ("tokenmill", "llama-server")
    # 4 warm-up requests (one per schema, not counted) and 40 measured, on each side.
    assert len(fake.fake.bodies) == 2 * (4 + 40)
    assert {json.dumps(b, sort_keys=True) for b in fake.fake.bodies[:44]} == {
        json.dumps(b, sort_keys=True) for b in fake.fake.bodies[44:]
    }  # the same requests to both
    assert fake.fake.most_in_flight == 16
    for side in (tokenmill, llama):
        assert side["model"] == "fake.gguf" and side["requests"] == 40
        assert (side["valid"], side["invalid"], side["failed"]) == (10, 20, 10)
        assert side["validity"] == pytest.approx(10 / 30)
        assert side["completion_tokens"] == 30 * TOKENS  # the answered ones
        assert side["tokens_per_s"] == pytest.approx(30 * TOKENS / side["wall_s"])
        assert side["by_schema"]["breaks"] == {"requests": 10, "valid": 0, "invalid": 10, "failed": 0}
        assert side["by_schema"]["refused"] == {"requests": 10, "valid": 0, "invalid": 0, "failed": 10}
        assert side["first_error"] == "HTTP 400: JSON schema conversion failed"
        assert side["latency_ms"]["count"] == 30
    table = capsys.readouterr().out
    assert "llama-server" in table and "33.3%" in table and "tokens/s tokenmill / llama-server" in table


def test_no_server_or_a_bad_schema_file_is_a_usage_error(tmp_path: Path) -> None:
    assert bench_main(["structured"]) == 2
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert bench_main(["structured", "--tokenmill", "http://127.0.0.1:9", "--schemas", str(bad)]) == 2
