"""HTTP errors in OpenAI's shape when the status is already sent: the error event of a stream that
fails midway (a worker lost past --max-resumptions, say) names the field as the caller did, with a
param and a code, like a plain error response does."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import grpc

from tokenmill_service.front.generation import ServiceError
from tokenmill_service.front.http.generation_response import GenerationResponse
from tokenmill_service.front.http.openai_errors import openai_error
from tokenmill_service.front.http.openai_protocol import parse_request
from tokenmill_service.front.http.openai_response import ResponseBuilder
from tokenmill_service.front.proto import pb


def stream_events(error: ServiceError, body: dict[str, Any]) -> list[Any]:
    parsed = parse_request({"messages": [{"role": "user", "content": "Hi"}], "stream": True, **body}, chat=True)

    async def responses() -> AsyncIterator[pb.GenerateResponse]:
        yield pb.GenerateResponse(request_id="r1", text="Hel")
        raise error

    sent: list[Any] = []

    async def run() -> None:
        never = asyncio.Event()

        async def receive() -> dict[str, Any]:
            await never.wait()  # the client stays connected
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        response = GenerationResponse([responses()], ResponseBuilder(parsed, "r1", "smol"), "r1")
        await response({"type": "http"}, receive, send)

    asyncio.run(run())
    assert sent[0]["status"] == 200
    chunks = [m["body"].decode() for m in sent[1:] if m.get("body")]
    return [json.loads(c.removeprefix("data: ")) for c in chunks]


def test_a_stream_that_fails_midway_ends_with_an_error_event_naming_the_callers_field() -> None:
    error = ServiceError(
        grpc.StatusCode.INVALID_ARGUMENT,
        "prompt tokens + max_new_tokens must be <= 64; given 60 prompt tokens and max_new_tokens 5",
        "stopping.max_new_tokens",
        "context_length_exceeded",
    )
    *chunks, event = stream_events(error, {"max_completion_tokens": 5})
    assert [c["choices"][0]["delta"] for c in chunks] == [{"role": "assistant", "content": ""}, {"content": "Hel"}]
    # Every chunk's choice has its logprobs (null without them), the role's first one too, as OpenAI's and the
    # description's do.
    assert [c["choices"][0]["logprobs"] for c in chunks] == [None, None]
    assert event == {
        "error": {
            "message": "prompt tokens + max_completion_tokens must be <= 64; given 60 prompt tokens and "
            "max_completion_tokens 5",
            "type": "invalid_request_error",
            "param": "max_completion_tokens",
            "code": "context_length_exceeded",
        }
    }


def test_an_error_without_a_field_gets_the_code_of_its_status() -> None:
    error = ServiceError(grpc.StatusCode.UNAVAILABLE, "the stream moved workers 2 times")
    event = stream_events(error, {})[-1]
    assert event["error"]["type"] == "service_unavailable_error"
    assert (event["error"]["param"], event["error"]["code"]) == (None, "service_unavailable")


def test_field_paths_become_openai_names_and_tokenmills_extras_keep_theirs() -> None:
    assert openai_error("sampling.top_k must be >= 0", "sampling.top_k") == ("top_k must be >= 0", "top_k")
    assert openai_error("stopping.stop[1] is empty", "stopping.stop") == ("stop[1] is empty", "stop")
    assert openai_error("token_ids.ids[3] = 99999 is outside", "token_ids.ids") == (
        "prompt[3] = 99999 is outside",
        "prompt",
    )
    assert openai_error("chat.messages: bad role", "chat.messages") == ("messages: bad role", "messages")
    assert openai_error("top_logprobs must be <= 20", "top_logprobs", {"top_logprobs": "logprobs"}) == (
        "logprobs must be <= 20",
        "logprobs",
    )
    assert openai_error("the prompt has 9000 tokens", "prompt") == ("the prompt has 9000 tokens", "prompt")
