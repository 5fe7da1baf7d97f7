"""JSON-schema output side by side with llama-server: ``tokenmill-bench structured``.

The same requests go to tokenmill and to a running llama.cpp ``llama-server``, through the route both
serve: ``POST /v1/chat/completions`` with OpenAI's ``response_format`` ``{"type": "json_schema",
"json_schema": {"name", "schema", "strict": true}}`` (llama-server reads the schema from there and turns it
into a grammar; tokenmill compiles it with its grammar engine). For every schema of the set (a built-in
set of typical schemas, or ``--schemas FILE``) a chat prompt asks for one such object; ``--requests``
requests cycle through the schemas, ``--concurrency`` (16) at a time in a closed loop, greedy, at most
``--max-tokens`` each, on one side and then on the other (each warmed first with one request per schema,
not measured, so compiling a schema is out of the measurement on both sides). For each side it reports:

- validity: answers that are JSON valid against their schema (``jsonschema``), that are not (bad JSON, or
  a schema violation: counted apart, with a first example), and requests refused or failed (HTTP errors,
  e.g. a schema feature one side cannot express);
- tokens/s: completion tokens (the server's ``usage``) of the measured requests over the wall time from
  the first send to the last answer, and the latency of a request (p50, p90).

Both servers should serve the same model (tokenmill a checkpoint, llama-server its GGUF) for the tokens/s
to compare; the model each side names is recorded.

    tokenmill-bench structured --tokenmill http://127.0.0.1:8000 --llama-server http://127.0.0.1:8089 \\
        --json bench/results/results-structured.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import jsonschema  # type: ignore[import-untyped]  # no stubs installed

from tokenmill_bench.stats import summarize_ms

TOKENMILL = "tokenmill"
LLAMA_SERVER = "llama-server"

# Typical extraction schemas: nested objects, bounded arrays, enums, numbers with ranges, anyOf, $defs.
DEFAULT_SCHEMAS: list[dict[str, Any]] = [
    {
        "name": "person",
        "prompt": "Describe a fictional person as JSON: name, age and city.",
        "schema": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 40},
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
                "city": {"type": "string", "maxLength": 40},
            },
            "required": ["name", "age", "city"],
            "additionalProperties": False,
        },
    },
    {
        "name": "product",
        "prompt": "Give a product of an online shop as JSON, with its price and up to three tags.",
        "schema": {
            "type": "object",
            "properties": {
                "title": {"type": "string", "maxLength": 60},
                "price": {"type": "number", "minimum": 0},
                "currency": {"enum": ["EUR", "USD", "GBP"]},
                "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
                "in_stock": {"type": "boolean"},
            },
            "required": ["title", "price", "currency", "tags", "in_stock"],
            "additionalProperties": False,
        },
    },
    {
        "name": "event",
        "prompt": "Invent a meeting as JSON: its title, a date (YYYY-MM-DD) and two to four participants.",
        "schema": {
            "type": "object",
            "properties": {
                "title": {"type": "string", "maxLength": 60},
                "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
                "participants": {
                    "type": "array",
                    "items": {"type": "string", "maxLength": 30},
                    "minItems": 2,
                    "maxItems": 4,
                },
            },
            "required": ["title", "date", "participants"],
            "additionalProperties": False,
        },
    },
    {
        "name": "order",
        "prompt": "Write a customer's order as JSON with one to three line items.",
        "schema": {
            "$defs": {
                "item": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "maxLength": 12},
                        "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                    },
                    "required": ["sku", "quantity"],
                    "additionalProperties": False,
                }
            },
            "type": "object",
            "properties": {
                "order_id": {"type": "integer", "minimum": 1},
                "items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1, "maxItems": 3},
                "status": {"enum": ["new", "paid", "shipped"]},
            },
            "required": ["order_id", "items", "status"],
            "additionalProperties": False,
        },
    },
    {
        "name": "answer",
        "prompt": "Is Paris the capital of France? Answer as JSON with a confidence between 0 and 1.",
        "schema": {
            "type": "object",
            "properties": {
                "answer": {"anyOf": [{"type": "boolean"}, {"type": "string", "maxLength": 20}]},
                "confidence": {"type": "number", "minimum": 0, "maximum": 1},
            },
            "required": ["answer", "confidence"],
            "additionalProperties": False,
        },
    },
]


@dataclass(frozen=True, slots=True)
class SchemaCase:
    """One schema of the set, and the prompt that asks for it."""

    name: str
    prompt: str
    schema: dict[str, Any]


def load_cases(path: Path | None) -> list[SchemaCase]:
    """The built-in set, or ``path``: a JSON list of ``{"name", "prompt", "schema"}`` (TypeError/ValueError
    otherwise; jsonschema.SchemaError for a schema that is not one)."""
    raw: Any = DEFAULT_SCHEMAS if path is None else json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(raw, list) or not raw:
        raise ValueError("the schemas must be a non-empty JSON list of {name, prompt, schema} objects")
    cases = []
    for i, entry in enumerate(raw):
        if not isinstance(entry, dict) or not isinstance(entry.get("schema"), dict):
            raise TypeError(f"schema {i}: expected an object with a 'schema' object")
        jsonschema.Draft202012Validator.check_schema(entry["schema"])
        name = str(entry.get("name") or f"schema_{i}")
        prompt = str(entry.get("prompt") or f"Produce one JSON value for the schema named {name}.")
        cases.append(SchemaCase(name, prompt, entry["schema"]))
    return cases


def chat_body(case: SchemaCase, max_tokens: int, model: str) -> dict[str, Any]:
    """The request both servers get: greedy, at most ``max_tokens``, the output bound to the case's schema."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": case.prompt}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": case.name, "schema": case.schema, "strict": True},
        },
    }


@dataclass
class Outcome:
    """One request's answer, judged."""

    schema: str
    latency_s: float = 0.0
    completion_tokens: int = 0
    finish_reason: str | None = None
    valid: bool = False
    problem: str | None = None
    """Why the answer is not valid: "json: ..." (not JSON), "schema: ..." (JSON that breaks the schema)."""
    error: str | None = None
    """The request failed or was refused (HTTP status and message, or the client's exception)."""


def judge(case: SchemaCase, status: int, body: Any, latency_s: float) -> Outcome:
    """An Outcome from a ``/v1/chat/completions`` answer (its HTTP status and decoded JSON body)."""
    outcome = Outcome(case.name, latency_s=latency_s)
    if status != 200 or not isinstance(body, dict) or "choices" not in body:
        error = body.get("error", body) if isinstance(body, dict) else body
        message = error.get("message", error) if isinstance(error, dict) else error
        outcome.error = f"HTTP {status}: {str(message)[:200]}"
        return outcome
    usage = body.get("usage") or {}
    outcome.completion_tokens = int(usage.get("completion_tokens") or 0)
    choice = (body.get("choices") or [{}])[0]
    outcome.finish_reason = choice.get("finish_reason")
    content = (choice.get("message") or {}).get("content") or ""
    try:
        value = json.loads(content)
    except json.JSONDecodeError as exc:
        outcome.problem = f"json: {exc.msg} (finish_reason={outcome.finish_reason}): {content[:120]!r}"
        return outcome
    try:
        jsonschema.validate(value, case.schema)
    except jsonschema.ValidationError as exc:
        outcome.problem = f"schema: {exc.message[:160]}"
        return outcome
    outcome.valid = True
    return outcome


@dataclass
class SideResult:
    """One server's measured requests and what they sum to."""

    name: str
    url: str
    model: str
    outcomes: list[Outcome] = field(default_factory=list)
    wall_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        answered = [o for o in self.outcomes if o.error is None]
        valid = sum(o.valid for o in answered)
        tokens = sum(o.completion_tokens for o in answered)
        by_schema: dict[str, dict[str, int]] = {}
        for o in self.outcomes:
            row = by_schema.setdefault(o.schema, {"requests": 0, "valid": 0, "invalid": 0, "failed": 0})
            row["requests"] += 1
            row["valid" if o.valid else "failed" if o.error is not None else "invalid"] += 1
        return {
            "server": self.name,
            "url": self.url,
            "model": self.model,
            "requests": len(self.outcomes),
            "valid": valid,
            "invalid": len(answered) - valid,
            "failed": len(self.outcomes) - len(answered),
            "validity": valid / len(answered) if answered else 0.0,
            "completion_tokens": tokens,
            "wall_s": self.wall_s,
            "tokens_per_s": tokens / self.wall_s if self.wall_s > 0 else 0.0,
            "latency_ms": summarize_ms([o.latency_s for o in answered]),
            "by_schema": by_schema,
            "first_problem": next((o.problem for o in self.outcomes if o.problem), None),
            "first_error": next((o.error for o in self.outcomes if o.error), None),
        }


async def _post(session: aiohttp.ClientSession, url: str, body: dict[str, Any], timeout: float) -> tuple[int, Any]:
    async with session.post(
        f"{url}/v1/chat/completions", json=body, timeout=aiohttp.ClientTimeout(total=timeout)
    ) as resp:
        text = await resp.text()
        try:
            return resp.status, json.loads(text)
        except json.JSONDecodeError:
            return resp.status, text


async def _one(
    session: aiohttp.ClientSession, url: str, case: SchemaCase, args: argparse.Namespace, model: str
) -> Outcome:
    start = time.perf_counter()
    try:
        status, body = await _post(session, url, chat_body(case, args.max_tokens, model), args.timeout)
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return Outcome(case.name, latency_s=time.perf_counter() - start, error=f"{type(exc).__name__}: {exc}")
    return judge(case, status, body, time.perf_counter() - start)


async def served_model(session: aiohttp.ClientSession, url: str) -> str:
    """The first model ``GET /v1/models`` names ("" when the server does not say)."""
    try:
        async with session.get(f"{url}/v1/models", timeout=aiohttp.ClientTimeout(total=10)) as resp:
            body = await resp.json(content_type=None)
        return str(body["data"][0]["id"])
    except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, IndexError, TypeError, ValueError):
        return ""


async def measure_side(name: str, url: str, cases: Sequence[SchemaCase], args: argparse.Namespace) -> SideResult:
    """Warm ``url`` with one request per schema, then send ``args.requests`` requests, ``args.concurrency``
    at a time (closed loop), cycling through the schemas."""
    url = url.rstrip("/")
    connector = aiohttp.TCPConnector(limit=0, force_close=True)  # llama-server drops idle keep-alives
    async with aiohttp.ClientSession(connector=connector) as session:
        model = args.model or await served_model(session, url)
        side = SideResult(name, url, model)
        for case in cases:
            await _one(session, url, case, args, model)
        queue: asyncio.Queue[SchemaCase] = asyncio.Queue()
        for i in range(args.requests):
            queue.put_nowait(cases[i % len(cases)])

        async def stream() -> None:
            while not queue.empty():
                side.outcomes.append(await _one(session, url, queue.get_nowait(), args, model))

        start = time.perf_counter()
        await asyncio.gather(*(stream() for _ in range(args.concurrency)))
        side.wall_s = time.perf_counter() - start
    return side


def format_table(sides: Sequence[dict[str, Any]]) -> str:
    header = f"{'server':<14}{'requests':>9}{'valid':>7}{'invalid':>8}{'failed':>7}{'validity':>9}{'tok/s':>9}"
    header += f"{'p50 ms':>9}{'p90 ms':>9}"
    lines = [header]
    for s in sides:
        lat = s["latency_ms"] or {}
        lines.append(
            f"{s['server']:<14}{s['requests']:>9}{s['valid']:>7}{s['invalid']:>8}{s['failed']:>7}"
            f"{s['validity']:>9.1%}{s['tokens_per_s']:>9.1f}{lat.get('p50', 0.0):>9.0f}{lat.get('p90', 0.0):>9.0f}"
        )
    for s in sides:
        for what in ("first_problem", "first_error"):
            if s[what]:
                lines.append(f"{s['server']} {what.replace('_', ' ')}: {s[what]}")
    if len(sides) == 2 and sides[1]["tokens_per_s"] > 0:
        ratio = sides[0]["tokens_per_s"] / sides[1]["tokens_per_s"]
        lines.append(f"tokens/s {sides[0]['server']} / {sides[1]['server']}: {ratio:.2f}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tokenmill-bench structured", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenmill", metavar="URL", help="a running tokenmill's HTTP API, e.g. http://127.0.0.1:8000")
    p.add_argument("--llama-server", metavar="URL", help="a running llama-server, e.g. http://127.0.0.1:8089")
    p.add_argument(
        "--schemas", type=Path, metavar="FILE", help="JSON list of {name, prompt, schema} (default: built-in)"
    )
    p.add_argument("--concurrency", type=int, default=16, help="streams at once (default 16)")
    p.add_argument("--requests", type=int, default=64, help="measured requests per server (default 64)")
    p.add_argument("--max-tokens", type=int, default=256, help="max_tokens of each request (default 256)")
    p.add_argument("--model", default="", help="the request's model field (default: each server's first model)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request (default 600)")
    p.add_argument("--json", type=Path, metavar="PATH", help="write the results here")
    return p


def structured_main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(argv)
    targets = [(n, u) for n, u in ((TOKENMILL, args.tokenmill), (LLAMA_SERVER, args.llama_server)) if u]
    if not targets:
        sys.stderr.write("tokenmill-bench structured: error: give --tokenmill URL and/or --llama-server URL\n")
        return 2
    if args.concurrency < 1 or args.requests < 1 or args.max_tokens < 1:
        sys.stderr.write("tokenmill-bench structured: error: --concurrency, --requests, --max-tokens must be >= 1\n")
        return 2
    try:
        cases = load_cases(args.schemas)
    except (OSError, TypeError, ValueError, jsonschema.SchemaError) as exc:
        sys.stderr.write(f"tokenmill-bench structured: error: {exc}\n")
        return 2
    summaries = [asyncio.run(measure_side(name, url, cases, args)).summary() for name, url in targets]
    sys.stdout.write(format_table(summaries) + "\n")
    if args.json is not None:
        result = {
            "concurrency": args.concurrency,
            "requests": args.requests,
            "max_tokens": args.max_tokens,
            "schemas": [asdict(c) for c in cases],
            "servers": summaries,
        }
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0
