"""Structured output through the OpenAI-compatible HTTP API, driven by real clients (the `openai` SDK and
LangChain) against the shared default server; every answer is validated against its schema."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from enum import Enum
from typing import Any

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.server_process import ServerProcess

MODEL = "tokenmill"


class Color(str, Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Fruit(BaseModel):
    name: str = Field(max_length=20)
    color: Color
    weight_grams: int = Field(ge=1, le=1000)


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.http_url + "/v1", api_key="none", max_retries=0, timeout=300) as c:
        yield c


def ask(text: str) -> list[Any]:
    return [{"role": "user", "content": text}]


def test_the_sdk_parses_a_pydantic_model_from_a_json_schema_answer(client: openai.OpenAI) -> None:
    reply = client.chat.completions.parse(
        model=MODEL, messages=ask("Describe an apple."), response_format=Fruit, max_tokens=60, temperature=0
    )
    fruit = reply.choices[0].message.parsed
    assert isinstance(fruit, Fruit) and 1 <= fruit.weight_grams <= 1000
    assert reply.choices[0].finish_reason == "stop"


def test_json_object_and_a_streamed_json_schema(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=ask("A JSON object about a cat."),
        response_format={"type": "json_object"},
        max_tokens=30,
        temperature=0,
    )
    assert (reply.choices[0].message.content or "").startswith("{")
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "population": {"type": "integer"}},
        "required": ["city", "population"],
        "additionalProperties": False,
    }
    chunks = client.chat.completions.create(
        model=MODEL,
        messages=ask("A city as JSON."),
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}},
        max_tokens=60,
        temperature=0.8,
        seed=3,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize(
    ("extra", "pattern"),
    [
        ({"guided_regex": r"[A-Z][a-z]{1,10}"}, r"[A-Z][a-z]{1,10}"),
        ({"guided_choice": ["yes", "no"]}, r"yes|no"),
        ({"guided_grammar": 'start: "a" "b"+'}, r"ab+"),
        ({"guided_grammar": 'root ::= "x" [0-9]'}, r"x[0-9]"),
        ({"structured_outputs": {"regex": r"[0-9]{3}"}}, r"[0-9]{3}"),
        ({"guided_json": {"type": "integer", "minimum": 5, "maximum": 9}}, r"[5-9]"),
    ],
)
def test_vllm_extras_constrain_the_text(client: openai.OpenAI, extra: dict[str, Any], pattern: str) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=ask("Answer."), max_tokens=12, temperature=0, extra_body=extra
    )
    assert re.fullmatch(pattern, reply.choices[0].message.content or ""), reply.choices[0].message.content


def test_two_constraints_in_one_request_are_a_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=MODEL,
            messages=ask("Hi"),
            response_format={"type": "json_object"},
            extra_body={"guided_regex": "a+"},
        )
    assert "at most one output constraint" in err.value.message


def test_langchain_with_structured_output(server: ServerProcess) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model=MODEL, base_url=server.http_url + "/v1", api_key="none", temperature=0, max_tokens=60, max_retries=0
    )
    fruit = llm.with_structured_output(Fruit, method="json_schema").invoke("Describe a banana.")
    assert isinstance(fruit, Fruit)
    jsonschema.validate(fruit.model_dump(mode="json"), Fruit.model_json_schema())


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, ADD)}  # type: ignore[index]


def test_tool_choice_required_gives_calls_whose_arguments_validate(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=ask("What is the weather in Paris?"),
        tools=[WEATHER, ADD],  # type: ignore[list-item]
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=60,
        temperature=0,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls or []
    assert len(calls) == 1 and calls[0].id.startswith("call_")
    jsonschema.validate(json.loads(calls[0].function.arguments), SCHEMAS[calls[0].function.name])  # type: ignore[union-attr]


def test_a_named_function_streams_tool_call_deltas_and_the_history_renders(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=ask("Add 2 and 3."),
            tools=[WEATHER, ADD],  # type: ignore[list-item]
            tool_choice={"type": "function", "function": {"name": "add"}},
            max_tokens=60,
            temperature=0,
            stream=True,
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert not "".join(d.content or "" for d in deltas).strip(), "a call leaked into the content"
    calls = [tc for d in deltas for tc in d.tool_calls or []]
    # Exactly one call of a named function (the model made the same call two or three times when it could).
    assert len(calls) == 1 and calls[0].function and calls[0].function.name == "add"
    args = json.loads(calls[0].function.arguments or "")
    jsonschema.validate(args, SCHEMAS["add"])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    # The call and its result go back into the conversation; the answer that follows is plain text.
    history = [
        *ask("Add 2 and 3."),
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": calls[0].id, "type": "function", "function": {"name": "add", "arguments": json.dumps(args)}}
            ],
        },
        {"role": "tool", "tool_call_id": calls[0].id, "content": str(args["a"] + args["b"])},
    ]
    reply = client.chat.completions.create(
        model=MODEL,
        messages=history,
        tools=[ADD],
        tool_choice="none",
        max_tokens=10,
        temperature=0,  # type: ignore[arg-type,list-item]
    )
    assert reply.choices[0].finish_reason in ("stop", "length") and not reply.choices[0].message.tool_calls


def test_langchain_bind_tools(server: ServerProcess) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model=MODEL, base_url=server.http_url + "/v1", api_key="none", temperature=0, max_tokens=60, max_retries=0
    )
    message = llm.bind_tools([WEATHER], tool_choice="required", parallel_tool_calls=False).invoke("Weather in Tokyo?")
    assert message.tool_calls and message.tool_calls[0]["name"] == "get_weather"  # type: ignore[attr-defined]
    jsonschema.validate(message.tool_calls[0]["args"], SCHEMAS["get_weather"])  # type: ignore[attr-defined]


CITY = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def test_forced_calls_are_distinct_and_end_the_answer_within_the_default_limits(client: openai.OpenAI) -> None:
    """A schema as a library sends it (no additionalProperties, no maxLength) and no max_tokens: a named
    function is called once; with required the model repeats get_weather {"city": "Rome"}, and the answer
    ends at the repeat with the call once."""
    for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        reply = client.chat.completions.create(
            model=MODEL,
            messages=ask("What's the weather in Rome?"),
            tools=[CITY],  # type: ignore[list-item]
            tool_choice=choice,  # type: ignore[arg-type]
            temperature=0,
        )
        message = reply.choices[0].message
        assert reply.choices[0].finish_reason == "tool_calls" and message.content is None, reply
        assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []] == [  # type: ignore[union-attr]
            ("get_weather", {"city": "Rome"})
        ]


def test_a_call_cut_off_by_max_tokens_is_neither_content_nor_a_call(client: openai.OpenAI) -> None:
    ask_for: dict[str, Any] = {
        "model": MODEL,
        "messages": ask("What's the weather in Rome?"),
        "tools": [CITY],
        "tool_choice": "required",
        "max_tokens": 8,
        "temperature": 0,
    }
    whole = client.chat.completions.create(**ask_for).choices[0]
    assert whole.finish_reason == "length" and not whole.message.content and not whole.message.tool_calls, whole
    chunks = [c.choices[0] for c in client.chat.completions.create(**ask_for, stream=True) if c.choices]
    assert "".join(c.delta.content or "" for c in chunks) == "" and not any(c.delta.tool_calls for c in chunks)
    assert chunks[-1].finish_reason == "length"
