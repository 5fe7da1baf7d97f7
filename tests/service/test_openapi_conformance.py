"""The HTTP API against its own description: schemathesis reads /openapi.json from a live server in the default
configuration and sends bodies generated from it, valid ones and ones that break it. No answer may be a 5xx, every
answer must be described (its status, its media type, its body, a stream's every event), and a body the
description refuses must be refused by the server (a 4xx): the description's bounds are the server's.

Every route is run, Anthropic's Messages API and OpenAI's Responses API too (their errors in their own shapes, their
streams' named events). The description's own example bodies go first: each generation route's whole and streamed
answer must be a 200, so every stream's events are checked whatever the generated bodies turn out to be (random
ones are mostly refused). Generated bodies are steered to short answers (at most 2 tokens, two choices, two
prompts, valid chats of at most LONGEST characters) so that a few hundred cases take seconds."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, assume, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import Failure, FailureGroup
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.server_process import ServerProcess

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    response_headers_conformance,
    negative_data_rejection,
]
# Each generation route's fields for the most tokens to generate, and whether a valid body may lack them (then the
# server's default applies: 1024).
TOKEN_FIELDS = {
    "/v1/chat/completions": (("max_tokens", "max_completion_tokens"), True),
    "/v1/completions": (("max_tokens", "max_completion_tokens"), True),
    "/v1/messages": (("max_tokens",), False),
    "/v1/responses": (("max_output_tokens",), True),
}
GENERATION = tuple(TOKEN_FIELDS)
# Cases per operation and kind (valid, invalid): generation costs a forward pass or two, the rest almost nothing.
EXAMPLES = {"generation": 8, "other": 15}
LONGEST = 2000  # characters of a generation's body
SHORT = 2


@pytest.fixture(scope="module")
def http_server() -> Iterator[ServerProcess]:
    # Its own server: generated requests load and unload LoRA adapters and fill queues at will.
    proc = ServerProcess("--drain-seconds", "2").start()
    yield proc
    proc.stop()


def _count(value: Any) -> bool:
    """An integer as JSON Schema reads one (5.0 too, which the server takes as 5)."""
    return (isinstance(value, int) and not isinstance(value, bool)) or (isinstance(value, float) and value.is_integer())


def steer(body: Any, path: str, valid: bool) -> None:
    """Bound a generation's cost without changing whether its body is valid: max_tokens (absent where it may be: the
    server's default, 1024) and n come down to SHORT; a valid list of prompts keeps its first SHORT."""
    if not isinstance(body, dict):
        return
    names, optional = TOKEN_FIELDS[path]
    for name in names:
        if _count(body.get(name)) and SHORT < body[name] <= 4096:
            body[name] = SHORT
    if optional and all(body.get(name) is None for name in names):
        body[names[0]] = SHORT
    if _count(body.get("n")) and SHORT < body["n"] <= 16:
        body["n"] = SHORT
    prompt = body.get("prompt")
    if valid and isinstance(prompt, list) and prompt and not all(_count(t) for t in prompt):
        body["prompt"] = prompt[:SHORT]


def send(op: schemathesis.APIOperation, case: schemathesis.Case, valid: bool, failures: list[str]) -> Any:
    """Send one case (a generation's steered short) and check its answer; its failures go to ``failures``."""
    if op.path in GENERATION:
        steer(case.body, op.path, valid)
    response = case.call(timeout=60)
    try:
        case.validate_response(response, checks=CHECKS)
    except (Failure, FailureGroup) as exc:  # every operation's failures, not only the first's
        failures.append(f"{op.label} ({'valid' if valid else 'invalid'} body {case.body!r}): {exc}")
    return response


def run_examples(op: schemathesis.APIOperation, failures: list[str]) -> None:
    """Send the description's own example bodies (each generation route's whole and streamed): each is answered
    200, as JSON or (with "stream") as an event stream, whose every event is checked."""
    content = op.definition.raw.get("requestBody", {}).get("content", {}).get("application/json", {})
    for name, example in content.get("examples", {}).items():
        body = copy.deepcopy(example["value"])
        response = send(op, op.Case(body=body, media_type="application/json"), True, failures)
        kind = response.headers.get("content-type", [""])[0]
        expected = "text/event-stream" if body.get("stream") else "application/json"
        if response.status_code != 200 or not kind.startswith(expected):
            failures.append(f"{op.label}'s example {name!r}: {response.status_code} {kind} {response.text[:300]}")


def run_cases(op: schemathesis.APIOperation, mode: GenerationMode, failures: list[str]) -> None:
    """Send ``op``'s generated cases of one kind."""
    generation = op.path in GENERATION

    @settings(
        max_examples=EXAMPLES["generation" if generation else "other"],
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(op.as_strategy(generation_mode=mode))
    def check(case: schemathesis.Case) -> None:
        valid = mode is GenerationMode.POSITIVE
        # A valid chat of many long random strings costs seconds of prefill, and tests nothing a short one does not.
        assume(not (generation and valid) or len(json.dumps(case.body, default=str)) <= LONGEST)
        send(op, case, valid, failures)

    check()


def test_every_answer_is_described_none_is_a_5xx_and_what_the_description_refuses_is_a_4xx(
    http_server: ServerProcess,
) -> None:
    schema = schemathesis.openapi.from_url(http_server.http_url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {
        *GENERATION,
        "/v1/messages/count_tokens",
        "/tokenize",
        "/v1/load_lora_adapter",
        "/health",
    }
    failures: list[str] = []
    for op in operations:
        run_examples(op, failures)
        run_cases(op, GenerationMode.POSITIVE, failures)
        if op.method.upper() == "POST":  # (a route without a body has nothing to break)
            run_cases(op, GenerationMode.NEGATIVE, failures)
    assert not failures, "\n\n".join(failures)
