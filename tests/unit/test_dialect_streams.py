"""The Messages and Responses APIs' streams as the HTTP layer sends them, from made-up engine outputs: what the
embedded model does not do on its own (text, then a call; a failure midway), framed as named server-sent
events, each as /openapi.json describes it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
import jsonschema

from tokenmill_service.front.generation import ServiceError
from tokenmill_service.front.http.anthropic_protocol import MESSAGES, MessagesBuilder, _matched_stop
from tokenmill_service.front.http.dialect import Dialect
from tokenmill_service.front.http.generation_response import GenerationResponse
from tokenmill_service.front.http.openai_response import ResponseBuilder
from tokenmill_service.front.http.openapi import document
from tokenmill_service.front.http.responses_protocol import RESPONSES, ResponsesBuilder
from tokenmill_service.front.proto import pb
from tokenmill_service.front.validation import Limits

CALL = pb.ToolCall(id="call_1", name="get_weather", arguments='{"city": "Rome"}')
# Text, then a call (the generation service holds a call's markup back: what reaches the HTTP layer is the text
# before it, then the parsed call), ending the answer.
WITH_CALL = [
    pb.GenerateResponse(text="Let me check. "),
    pb.GenerateResponse(
        finish_reason=pb.FINISH_REASON_TOOL_CALLS,
        tool_calls=[CALL],
        usage=pb.Usage(prompt_tokens=20, completion_tokens=9),
    ),
]


DOCUMENT = document(Limits(8192, 49152, 4096, 20, 16), "1")
ROUTES = {MESSAGES: "/v1/messages", RESPONSES: "/v1/responses"}


def described(dialect: Dialect, name: str, data: dict[str, Any]) -> None:
    """``data`` is what the description says an event named ``name`` holds (the schemas of its route's stream)."""
    stream = DOCUMENT["paths"][ROUTES[dialect]]["post"]["responses"]["200"]["content"]["text/event-stream"]["schema"]
    assert name in stream["properties"]["event"]["enum"]
    (rule,) = (rule for rule in stream["allOf"] if rule["if"]["properties"]["event"]["const"] == name)
    jsonschema.validate(data, rule["then"]["properties"]["data"]["contentSchema"])


def streamed(
    dialect: Dialect, body: dict[str, Any], outputs: Sequence[pb.GenerateResponse], error: ServiceError | None = None
) -> list[tuple[str, dict[str, Any]]]:
    """The (event name, data) pairs a stream sends."""
    parsed = dialect.parse({**body, "stream": True})

    async def responses() -> AsyncIterator[pb.GenerateResponse]:
        for out in outputs:
            yield out
        if error is not None:
            raise error

    sent: list[Any] = []

    async def run() -> None:
        never = asyncio.Event()

        async def receive() -> dict[str, Any]:
            await never.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        builder: ResponseBuilder = dialect.builder(parsed, "r1", "smol")
        await GenerationResponse([responses()], builder, "r1")({"type": "http"}, receive, send)

    asyncio.run(run())
    assert sent[0]["status"] == 200 and sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    events = []
    for message in sent[1:-1]:
        name, data = message["body"].decode().removesuffix("\n\n").split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}"
        described(dialect, event["type"], event)
        events.append(event)
    return [(e["type"], e) for e in events]


WEATHER = {"name": "get_weather", "input_schema": {"type": "object"}}
ASK = [{"role": "user", "content": "Weather in Rome?"}]


def test_a_messages_stream_sends_the_text_block_then_the_tool_use_block() -> None:
    events = streamed(MESSAGES, {"max_tokens": 50, "messages": ASK, "tools": [WEATHER]}, WITH_CALL)
    assert [name for name, _ in events] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    data = [e for _, e in events]
    assert data[2]["delta"] == {"type": "text_delta", "text": "Let me check. "}
    assert data[4] == {
        "type": "content_block_start",
        "index": 1,
        "content_block": {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {}},
    }
    assert data[5]["delta"] == {"type": "input_json_delta", "partial_json": '{"city": "Rome"}'}
    assert data[7]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert data[7]["usage"] == {"input_tokens": 20, "output_tokens": 9}


def test_a_messages_stream_that_fails_midway_ends_with_an_error_event_in_anthropics_shape() -> None:
    error = ServiceError(grpc.StatusCode.UNAVAILABLE, "the stream moved workers 2 times")
    events = streamed(MESSAGES, {"max_tokens": 50, "messages": ASK}, WITH_CALL[:1], error)
    assert [name for name, _ in events][-1] == "error"
    assert events[-1][1] == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "the stream moved workers 2 times"},
    }


def test_a_responses_stream_sends_the_message_item_then_the_function_call_item() -> None:
    tool = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}
    events = streamed(RESPONSES, {"input": "Weather in Rome?", "tools": [tool]}, WITH_CALL)
    assert [name for name, _ in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    data = [e for _, e in events]
    assert [e["sequence_number"] for e in data] == list(range(len(data)))
    assert data[5]["text"] == "Let me check. " and data[8]["output_index"] == 1
    final = data[-1]["response"]
    assert final["status"] == "completed" and [item["type"] for item in final["output"]] == ["message", "function_call"]
    assert final["output"][1] == {
        "type": "function_call",
        "id": "fc_1",
        "call_id": "call_1",
        "name": "get_weather",
        "arguments": '{"city": "Rome"}',
        "status": "completed",
    }
    assert final["usage"]["input_tokens"] == 20 and final["usage"]["total_tokens"] == 29


def test_a_responses_stream_that_fails_midway_ends_with_an_error_event() -> None:
    error = ServiceError(
        grpc.StatusCode.INVALID_ARGUMENT, "stopping.max_new_tokens is too large", "stopping.max_new_tokens"
    )
    events = streamed(RESPONSES, {"input": "Hi"}, WITH_CALL[:1], error)
    name, event = events[-1]
    assert name == "error" and event["param"] == "max_output_tokens"
    assert event["message"] == "max_output_tokens is too large" and event["sequence_number"] == len(events) - 1


def test_the_stop_sequence_named_is_the_one_the_tokens_run_into() -> None:
    assert _matched_stop(["END", "stop"], "the text ", "the text stop END") == "stop"
    assert _matched_stop(["ab", "a"], "x", "xab") == "ab"  # at the same place: the longer one
    assert _matched_stop(["END"], "x", "x") == "END"  # (the tokens' text always shows it; one is all it can be)
    assert MessagesBuilder.STREAM_END == ResponsesBuilder.STREAM_END == b""
