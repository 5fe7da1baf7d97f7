"""OpenAI's Responses API end to end: the real `openai` SDK (and plain HTTP for what it will not send) against
the shared default server, each answer held against the same request through /v1/chat/completions."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from enum import Enum
from typing import Any

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.server_process import ServerProcess

MODEL = "tokenmill"
INSTRUCTIONS = "Answer in one short sentence."
QUESTION = "What is the capital of France?"
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER: Any = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": WEATHER_SCHEMA,
}
RAIN = "What is the weather in Paris?"


class Color(str, Enum):
    red = "red"
    green = "green"


class Fruit(BaseModel):
    name: str = Field(max_length=20)
    color: Color


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.http_url + "/v1", api_key="none", max_retries=0, timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def france(client: openai.OpenAI) -> Any:
    """The greedy chat answer every response about France is held against."""
    messages: Any = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}]
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)


def post(server: ServerProcess, body: Any) -> tuple[int, Any]:
    request = urllib.request.Request(
        server.http_url + "/v1/responses", json.dumps(body).encode(), {"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_a_response_is_the_chat_answer_as_a_message_item_with_usage(client: openai.OpenAI, france: Any) -> None:
    reply = client.responses.create(
        model=MODEL, instructions=INSTRUCTIONS, input=QUESTION, max_output_tokens=12, temperature=0, store=False
    )
    assert reply.object == "response" and reply.id.startswith("resp_") and reply.store is False
    assert [item.type for item in reply.output] == ["message"]
    assert reply.output_text == france.choices[0].message.content and "Paris" in reply.output_text
    assert reply.status == ("completed" if france.choices[0].finish_reason == "stop" else "incomplete")
    assert reply.usage is not None and reply.usage.input_tokens == france.usage.prompt_tokens
    assert reply.usage.output_tokens == france.usage.completion_tokens
    assert reply.usage.total_tokens == reply.usage.input_tokens + reply.usage.output_tokens
    assert reply.instructions == INSTRUCTIONS and reply.max_output_tokens == 12 and reply.temperature == 0


def test_a_streamed_response_sends_the_responses_events_in_order_with_the_same_text(
    client: openai.OpenAI, france: Any
) -> None:
    message: Any = [{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}]
    events = list(
        client.responses.create(
            model=MODEL, instructions=INSTRUCTIONS, input=message, max_output_tokens=12, temperature=0, stream=True
        )
    )
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 1
    end = "response.completed" if france.choices[0].finish_reason == "stop" else "response.incomplete"
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        end,
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == france.choices[0].message.content
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text == text and final.usage.output_tokens == france.usage.completion_tokens


def test_max_output_tokens_reached_is_incomplete(client: openai.OpenAI) -> None:
    reply = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=3, temperature=0)
    assert reply.status == "incomplete" and reply.incomplete_details is not None
    assert reply.incomplete_details.reason == "max_output_tokens"
    assert reply.usage is not None and reply.usage.output_tokens == 3
    assert reply.output[0].status == "incomplete"  # type: ignore[union-attr]


def test_a_named_function_streams_a_function_call_item_and_its_output_goes_back(client: openai.OpenAI) -> None:
    with client.responses.stream(
        model=MODEL,
        input=RAIN,
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        parallel_tool_calls=False,
        max_output_tokens=60,
        temperature=0,
    ) as stream:
        kinds = [event.type for event in stream]
        response = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    assert "response.output_text.delta" not in kinds, "a call leaked into the text"
    (call,) = response.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER_SCHEMA)
    # The call and its output go back as the Agents SDK sends them; the answer is the chat API's for the same talk.
    follow_up: Any = [
        {"role": "user", "content": RAIN},
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 C"},
    ]
    reply = client.responses.create(model=MODEL, input=follow_up, tools=[WEATHER], max_output_tokens=10, temperature=0)
    history: Any = [
        {"role": "user", "content": RAIN},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 24 C"},
    ]
    tools: Any = [{"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}]
    same = client.chat.completions.create(model=MODEL, messages=history, tools=tools, max_tokens=10, temperature=0)
    assert reply.output_text == same.choices[0].message.content


def test_text_format_json_schema_is_parsed_by_the_sdk(client: openai.OpenAI) -> None:
    reply = client.responses.parse(
        model=MODEL, input="Describe an apple.", text_format=Fruit, max_output_tokens=40, temperature=0
    )
    assert reply.status == "completed" and isinstance(reply.output_parsed, Fruit)


def test_previous_response_id_is_refused_the_server_keeps_no_responses(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input=QUESTION, previous_response_id="resp_123")
    assert err.value.status_code == 400 and "keeps no responses" in err.value.message
    assert err.value.param == "previous_response_id"  # type: ignore[attr-defined]


BAD: list[tuple[dict[str, Any], str, str]] = [
    ({}, "input", "'input' is required"),
    ({"input": 7}, "input", "'input' must be a string or a non-empty list"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input", "items of type 'input_image'"),
    (
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
        "input",
        "a part of type 'input_image' is not supported",
    ),
    ({"input": "hi", "max_output_tokens": "ten"}, "max_output_tokens", "'max_output_tokens' must be an integer"),
    ({"input": "hi", "max_output_tokens": 100000}, "max_output_tokens", "max_output_tokens must be <="),
    ({"input": "hi", "temperature": "hot"}, "temperature", "'temperature' must be a number"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools", "tools of type 'web_search'"),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice", "no 'tools' are given"),
    ({"input": "hi", "text": {"format": {"type": "yaml"}}}, "text.format", "'text.format.type' must be"),
    (
        {"input": "hi", "text": {"format": {"type": "json_schema", "name": "bad name!", "schema": {}}}},
        "text.format.name",
        "'text.format.name' must be",
    ),
    ({"input": "hi", "background": True}, "background", "'background' is not supported"),
    # Each was taken before /openapi.json described the body (schemathesis sent them): metadata was repeated in the
    # answer whatever it was, a tool's description of 0 read as none, a null schema as any JSON object, and reasoning
    # items alone were refused as 'messages'.
    ({"input": "hi", "metadata": "team"}, "metadata", "'metadata' must be an object"),
    (
        {"input": "hi", "tools": [{"type": "function", "name": "f", "description": 0}]},
        "tools",
        "tools[0].description must be a string",
    ),
    (
        {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": None}}},
        "text.format",
        "needs a 'schema'",
    ),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input", "'input' holds no message"),
]


@pytest.mark.parametrize(("body", "param", "message"), BAD, ids=[m for _, _, m in BAD])
def test_bad_input_is_a_400_naming_the_field(
    server: ServerProcess, body: dict[str, Any], param: str, message: str
) -> None:
    status, reply = post(server, {"model": MODEL, **body})
    assert status == 400, reply
    error = reply["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and message in error["message"]


def test_an_integer_written_with_a_zero_fraction_is_taken_as_that_integer(server: ServerProcess) -> None:
    # (JSON Schema's integer, as /openapi.json describes max_output_tokens: schemathesis sent 228.0.)
    status, reply = post(server, {"model": MODEL, "input": QUESTION, "max_output_tokens": 3.0, "temperature": 0})
    assert status == 200, reply
    assert reply["usage"]["output_tokens"] <= 3 and type(reply["max_output_tokens"]) is int


def test_the_openai_agents_sdk_runs_an_agent_on_the_server(server: ServerProcess, france: Any) -> None:
    """The Agents SDK example (docs/messages-and-responses.md): an agent on OpenAIResponsesModel answers as the
    chat route does."""
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, set_tracing_disabled

    set_tracing_disabled(True)
    agent_client = openai.AsyncOpenAI(base_url=server.http_url + "/v1", api_key="none", max_retries=0, timeout=300)
    agent = Agent(
        name="helper",
        instructions=INSTRUCTIONS,
        model=OpenAIResponsesModel(MODEL, agent_client),
        model_settings=ModelSettings(temperature=0, max_tokens=12),
    )
    result = Runner.run_sync(agent, QUESTION)
    assert result.final_output == france.choices[0].message.content
