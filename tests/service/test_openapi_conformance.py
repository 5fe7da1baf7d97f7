"""The HTTP API against its own description: schemathesis reads /openapi.json from a live server in the default
configuration and sends bodies generated from it, valid ones and ones that break it. No answer may be a 5xx, every
answer must be described (its status, its media type, its body, a stream's every event), and a body the
description refuses must be refused by the server (a 4xx): the description's bounds are the server's.

Generated bodies are steered to short answers (max_tokens 2, two choices, two prompts) so that a few hundred cases
take seconds."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
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
GENERATION = ("/v1/chat/completions", "/v1/completions")
# Cases per operation and kind (valid, invalid): generation costs a forward pass or two, the rest almost nothing.
EXAMPLES = {"generation": 12, "other": 15}
SHORT = 2


@pytest.fixture(scope="module")
def http_server() -> Iterator[ServerProcess]:
    # Its own server: generated requests load and unload LoRA adapters and fill queues at will.
    proc = ServerProcess("--drain-seconds", "2").start()
    yield proc
    proc.stop()


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def steer(body: Any, valid: bool) -> None:
    """Bound a generation's cost without changing whether its body is valid: max_tokens (absent: the server's
    default, 1024) and n come down to SHORT; a valid list of prompts keeps its first SHORT."""
    if not isinstance(body, dict):
        return
    for name in ("max_tokens", "max_completion_tokens"):
        if _count(body.get(name)) and SHORT < body[name] <= 4096:
            body[name] = SHORT
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = SHORT
    if _count(body.get("n")) and SHORT < body["n"] <= 16:
        body["n"] = SHORT
    prompt = body.get("prompt")
    if valid and isinstance(prompt, list) and prompt and not all(_count(t) for t in prompt):
        body["prompt"] = prompt[:SHORT]


def run_cases(op: schemathesis.APIOperation, mode: GenerationMode, failures: list[str]) -> None:
    """Send ``op``'s generated cases of one kind; each failing case's failures go to ``failures``."""
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
        if generation:
            steer(case.body, valid=mode is GenerationMode.POSITIVE)
        response = case.call(timeout=60)
        try:
            case.validate_response(response, checks=CHECKS)
        except (Failure, FailureGroup) as exc:  # every operation's failures, not only the first's
            failures.append(f"{op.label} ({mode.value}): {exc}")

    check()


def test_every_answer_is_described_none_is_a_5xx_and_what_the_description_refuses_is_a_4xx(
    http_server: ServerProcess,
) -> None:
    schema = schemathesis.openapi.from_url(http_server.http_url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {*GENERATION, "/tokenize", "/v1/load_lora_adapter", "/health"}
    failures: list[str] = []
    for op in operations:
        run_cases(op, GenerationMode.POSITIVE, failures)
        if op.method.upper() == "POST":  # (a route without a body has nothing to break)
            run_cases(op, GenerationMode.NEGATIVE, failures)
    assert not failures, "\n\n".join(failures)
