"""Fifty-odd JSON schemas (tests/data/json_schemas.json: nested objects, bounded arrays, enums, anyOf, string
patterns and formats, number ranges, $ref/$defs, additionalProperties false) through the shared default
server, greedy and sampled, all at once: every answer is valid against its schema, and the schemas with
features the server does not enforce are refused with INVALID_ARGUMENT naming the feature."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import grpc
import jsonschema
import pytest

from tests.conftest import DATA
from tests.server_process import ServerProcess
from tokenmill_client._proto import generate_pb2 as pb
from tokenmill_client._proto import generate_pb2_grpc as pb_grpc

CASES = json.loads((DATA / "json_schemas.json").read_text())
# Strings, arrays and numbers' digits (multipleOf) in the schemas are bounded, so every answer fits: unbounded, a
# 135M model may write digits or nest children until max_new_tokens.
MAX_NEW_TOKENS = 160
# RFC 3339's full-time (jsonschema's own "time" check needs a package this project does not install).
RFC3339_TIME = re.compile(
    r"([01][0-9]|2[0-3]):[0-5][0-9]:([0-5][0-9]|60)(\.[0-9]+)?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
)
FORMATS = jsonschema.FormatChecker()
FORMATS.checks("time")(lambda value: not isinstance(value, str) or RFC3339_TIME.fullmatch(value) is not None)


def request(case: dict[str, Any], sampled: bool) -> pb.GenerateRequest:
    r = pb.GenerateRequest(
        chat=pb.Messages(messages=[pb.ChatMessage(role="user", content=case["prompt"] + " Answer in JSON.")]),
        json_schema=json.dumps(case["schema"]),
        stopping=pb.StoppingParams(max_new_tokens=MAX_NEW_TOKENS),
    )
    if sampled:
        r.sampling.temperature, r.sampling.seed = 1.0, 11
    return r


async def answer(stub: pb_grpc.GenerationStub, r: pb.GenerateRequest) -> tuple[str, int]:
    text, finish = "", 0
    async for m in stub.Generate(r, timeout=600):
        text += m.text
        finish = m.finish_reason or finish
    return text, finish


def test_at_least_fifty_schemas_give_valid_json_greedy_and_sampled(server: ServerProcess) -> None:
    cases = CASES["schemas"]
    assert len(cases) >= 50

    async def run() -> list[tuple[str, int]]:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            reqs = [request(c, sampled) for sampled in (False, True) for c in cases]
            return list(await asyncio.gather(*(answer(stub, r) for r in reqs)))

    results = asyncio.run(run())
    failures = []
    for i, (text, finish) in enumerate(results):
        case, mode = cases[i % len(cases)], ("greedy", "sampled")[i // len(cases)]
        try:
            assert finish == pb.FINISH_REASON_EOS, f"finish reason {finish}"
            jsonschema.validate(json.loads(text), case["schema"], format_checker=FORMATS)
        except (AssertionError, ValueError, jsonschema.ValidationError) as exc:
            failures.append(f"{case['name']} ({mode}): {str(exc).splitlines()[0]}: {text!r}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("case", CASES["refused"], ids=lambda c: c["name"])
def test_a_schema_feature_the_server_does_not_enforce_is_refused(server: ServerProcess, case: dict[str, Any]) -> None:
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(pb.GenerateRequest(prompt="x", json_schema=json.dumps(case["schema"])), timeout=60))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "json_schema: the json_schema cannot be used" in (err.value.details() or "")
