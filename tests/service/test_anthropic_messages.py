"""Anthropic's Messages API end to end: the real `anthropic` SDK (and plain HTTP for what it will not send)
against the shared default server, each answer held against the same request through /v1/chat/completions.

Greedy requests give ``temperature: 0`` through ``extra_body``: the SDK no longer has the parameter, which
llama.cpp's server and tokenmill still take. Auth by x-api-key is checked in test_service_lifecycle.py,
whose server has a token.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import jsonschema
import openai
import pytest

from tests.server_process import ServerProcess
from tests.service.chat_dialects import INSTRUCTIONS as SYSTEM
from tests.service.chat_dialects import (
    MODEL,
    QUESTION,
    RAIN,
    WEATHER_DESCRIPTION,
    WEATHER_SCHEMA,
    post,
)

GREEDY = {"temperature": 0}
FRANCE: list[Any] = [{"role": "user", "content": QUESTION}]
WEATHER: Any = {"name": "get_weather", "description": WEATHER_DESCRIPTION, "input_schema": WEATHER_SCHEMA}


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=server.http_url, api_key="none", max_retries=0, timeout=300) as c:
        yield c


def test_a_message_is_the_chat_answer_as_a_text_block_with_stop_reason_and_usage(
    client: anthropic.Anthropic, france: Any
) -> None:
    reply = client.messages.create(model=MODEL, max_tokens=12, system=SYSTEM, messages=FRANCE, extra_body=GREEDY)
    assert reply.type == "message" and reply.role == "assistant" and reply.id.startswith("msg_")
    assert [block.type for block in reply.content] == ["text"]
    assert reply.content[0].text == france.choices[0].message.content  # type: ignore[union-attr]
    assert "Paris" in reply.content[0].text  # type: ignore[union-attr]
    assert reply.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[france.choices[0].finish_reason]
    assert reply.usage.input_tokens == france.usage.prompt_tokens
    assert reply.usage.output_tokens == france.usage.completion_tokens


def test_a_streamed_message_sends_anthropics_events_in_order_with_the_same_text(
    client: anthropic.Anthropic, france: Any
) -> None:
    events = list(
        client.messages.create(
            model=MODEL,
            max_tokens=12,
            system=[{"type": "text", "text": SYSTEM}],
            messages=FRANCE,
            stream=True,
            extra_body=GREEDY,
        )
    )
    kinds = [e.type for e in events]
    deltas = kinds.count("content_block_delta")
    assert deltas >= 1
    assert kinds == [
        "message_start",
        "content_block_start",
        *["content_block_delta"] * deltas,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta")
    assert text == france.choices[0].message.content
    end = events[-2]
    assert end.type == "message_delta" and end.usage.output_tokens == france.usage.completion_tokens
    assert end.usage.input_tokens == france.usage.prompt_tokens


def test_a_stop_sequence_ends_the_text_before_it_and_is_named(client: anthropic.Anthropic, france: Any) -> None:
    text = france.choices[0].message.content
    word = text.split()[2]  # from the middle of the greedy answer
    reply = client.messages.create(
        model=MODEL,
        max_tokens=12,
        system=SYSTEM,
        messages=FRANCE,
        stop_sequences=["never in this answer", word],
        extra_body=GREEDY,
    )
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == word
    assert reply.content[0].text == text[: text.index(word)]  # type: ignore[union-attr]


def test_max_tokens_reached_is_the_stop_reason(client: anthropic.Anthropic) -> None:
    reply = client.messages.create(model=MODEL, max_tokens=3, messages=FRANCE, extra_body=GREEDY)
    assert reply.stop_reason == "max_tokens" and reply.usage.output_tokens == 3


def test_a_forced_tool_streams_a_tool_use_block_and_its_result_goes_back(
    client: anthropic.Anthropic, chat_client: openai.OpenAI
) -> None:
    question: Any = [{"role": "user", "content": RAIN}]
    with client.messages.stream(
        model=MODEL,
        max_tokens=60,
        messages=question,
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        extra_body=GREEDY,
    ) as stream:
        message = stream.get_final_message()
    assert message.stop_reason == "tool_use"
    (call,) = message.content  # no text: the call alone, its input read from input_json_delta by the SDK
    assert call.type == "tool_use" and call.name == "get_weather"
    jsonschema.validate(call.input, WEATHER_SCHEMA)
    # The call and its result go back; the answer is the one the chat API gives the same conversation.
    history: Any = [
        *question,
        {"role": "assistant", "content": [call.model_dump(include={"type", "id", "name", "input"})]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 24 C"}]},
    ]
    # (tool_choice none: with tools offered the greedy answer may call again, and a call cut off at max_tokens is
    # no call and no text, on both routes alike.)
    reply = client.messages.create(
        model=MODEL, max_tokens=10, messages=history, tools=[WEATHER], tool_choice={"type": "none"}, extra_body=GREEDY
    )
    chat_history: Any = [
        *question,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": json.dumps(call.input)},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 C"},
    ]
    tools: Any = [
        {
            "type": "function",
            "function": {"name": "get_weather", "description": WEATHER["description"], "parameters": WEATHER_SCHEMA},
        }
    ]
    same = chat_client.chat.completions.create(
        model=MODEL, messages=chat_history, tools=tools, tool_choice="none", max_tokens=10, temperature=0
    )
    assert reply.content and reply.content[0].type == "text"
    assert reply.content[0].text == same.choices[0].message.content


def test_count_tokens_counts_the_prompt_a_message_would_have(client: anthropic.Anthropic, france: Any) -> None:
    counted = client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=FRANCE)
    assert counted.input_tokens == france.usage.prompt_tokens
    # Tools are offered in the prompt: they count.
    with_tools = client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=FRANCE, tools=[WEATHER])
    assert with_tools.input_tokens > counted.input_tokens + len(json.dumps(WEATHER_SCHEMA)) // 8


BAD: list[tuple[dict[str, Any], str]] = [
    ({"messages": FRANCE}, "'max_tokens' is required"),
    ({"max_tokens": "ten", "messages": FRANCE}, "'max_tokens' must be an integer"),
    ({"max_tokens": 0, "messages": FRANCE}, "'max_tokens' must be >= 1"),
    ({"max_tokens": 5, "messages": "hello"}, "'messages' must be a non-empty list"),
    ({"max_tokens": 5, "messages": [{"role": "robot", "content": "hi"}]}, "messages[0] must be an object with 'role'"),
    ({"max_tokens": 5, "messages": FRANCE, "stop_sequences": "END"}, "'stop_sequences' must be a list of strings"),
    ({"max_tokens": 5, "messages": FRANCE, "stop_sequences": [""]}, "stop_sequences[0] is empty"),
    ({"max_tokens": 5, "messages": FRANCE, "temperature": "hot"}, "'temperature' must be a number"),
    ({"max_tokens": 5, "messages": FRANCE, "system": 7}, "'system' must be a string or a list of text blocks"),
    ({"max_tokens": 5, "messages": FRANCE, "tool_choice": {"type": "any"}}, "asks for a call but no 'tools'"),
    ({"max_tokens": 5, "messages": FRANCE, "tools": [{"name": "f"}]}, "tools[0].input_schema must be"),
    (
        {"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
        "a block of type 'image' is not supported",
    ),
    ({"max_tokens": 100000, "messages": FRANCE}, "max_tokens"),
]


@pytest.mark.parametrize(("body", "message"), BAD, ids=[m for _, m in BAD])
def test_bad_input_is_a_400_in_anthropics_error_shape(
    server: ServerProcess, body: dict[str, Any], message: str
) -> None:
    status, reply = post(server, "/v1/messages", {"model": MODEL, **body})
    assert status == 400, reply
    assert reply["type"] == "error" and reply["error"]["type"] == "invalid_request_error"
    assert message in reply["error"]["message"]
    assert "stopping." not in reply["error"]["message"] and "max_new_tokens" not in reply["error"]["message"]


def test_an_integer_written_with_a_zero_fraction_is_taken_as_that_integer(server: ServerProcess) -> None:
    # (JSON Schema's integer, as /openapi.json describes max_tokens and top_k: schemathesis sent 228.0.)
    status, reply = post(server, "/v1/messages", {"model": MODEL, "max_tokens": 3.0, "top_k": 1.0, "messages": FRANCE})
    assert status == 200, reply
    assert reply["stop_reason"] == "max_tokens" and reply["usage"]["output_tokens"] == 3


def test_count_tokens_reads_only_what_makes_the_prompt(server: ServerProcess) -> None:
    # As Anthropic's: sampling, stop sequences, stream and max_tokens change the answer, not the prompt.
    status, plain = post(server, "/v1/messages/count_tokens", {"model": MODEL, "messages": FRANCE})
    assert status == 200, plain
    others = {"max_tokens": 0, "temperature": "hot", "stop_sequences": [""], "stream": 1}
    assert post(server, "/v1/messages/count_tokens", {"model": MODEL, "messages": FRANCE, **others}) == (200, plain)


def test_the_sdk_raises_its_bad_request_error(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model=MODEL, max_tokens=5, messages=FRANCE, stop_sequences=[""])
    assert err.value.status_code == 400 and "stop_sequences[0] is empty" in err.value.message
