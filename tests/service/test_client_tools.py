"""Tools through the typed client and the CLI: tools offered, tool_choice, the calls read back (streamed and
aggregated) and a history carrying calls and their results, against the shared default server."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from tests.service.test_client_cli import error_lines, run_cli
from tokenmill_client import (
    ChatMessage,
    Client,
    FinishReason,
    FunctionChoice,
    GenerateEvent,
    GenerateOptions,
    InvalidRequestError,
    Tool,
    ToolCall,
)
from tokenmill_client._chat import to_chat_messages
from tokenmill_client._convert import ResultBuilder, build_generate_request
from tokenmill_client._proto import generate_pb2 as pb

WEATHER_PARAMS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME_PARAMS: dict[str, Any] = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "maxLength": 30}},
    "required": ["timezone"],
    "additionalProperties": False,
}
# OpenAI's shape, as an application (and --tools FILE) gives it.
OPENAI_TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "The weather in a city.", "parameters": WEATHER_PARAMS},
    },
    {"type": "function", "function": {"name": "get_time", "description": "The time.", "parameters": TIME_PARAMS}},
]
SCHEMAS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
QUESTION = [("user", "What is the weather in Rome?")]

# --------------------------------------------------------------------------------- no server needed


def test_tools_tool_choice_and_a_history_with_calls_reach_the_request() -> None:
    options = GenerateOptions(tools=OPENAI_TOOLS, tool_choice=FunctionChoice("get_time"), parallel_tool_calls=False)
    assert options.tools == (
        Tool("get_weather", "The weather in a city.", WEATHER_PARAMS),
        Tool("get_time", "The time.", json.dumps(TIME_PARAMS)),
    )
    assert hash(options) == hash(dataclasses.replace(options))
    history = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "sunny"},
    ]
    request = build_generate_request(None, history, None, options)
    assert [t.name for t in request.tools] == ["get_weather", "get_time"]
    assert json.loads(request.tools[0].parameters) == WEATHER_PARAMS
    assert request.tool_choice == pb.TOOL_CHOICE_FUNCTION and request.tool_choice_function == "get_time"
    assert request.HasField("parallel_tool_calls") and not request.parallel_tool_calls
    assistant, tool = request.chat.messages[1], request.chat.messages[2]
    assert assistant.content == "" and [(c.id, c.name, c.arguments) for c in assistant.tool_calls] == [
        ("call_1", "get_weather", "{}")
    ]
    assert (tool.role, tool.tool_call_id, tool.name, tool.content) == ("tool", "call_1", "get_weather", "sunny")
    assert to_chat_messages(history)[1] == ChatMessage("assistant", "", (ToolCall("call_1", "get_weather", "{}"),))
    plain = build_generate_request("hi", None, None, GenerateOptions())
    assert not plain.tools and plain.tool_choice == pb.TOOL_CHOICE_AUTO and not plain.HasField("parallel_tool_calls")
    required = build_generate_request(None, history, None, GenerateOptions(tools=OPENAI_TOOLS, tool_choice="required"))
    assert required.tool_choice == pb.TOOL_CHOICE_REQUIRED


@pytest.mark.parametrize(
    ("tool", "error"),
    [({"type": "retrieval"}, ValueError), ({"type": "function", "function": {"description": "no name"}}, TypeError)],
)
def test_a_malformed_tool_is_refused_before_any_call(tool: dict[str, Any], error: type[Exception]) -> None:
    with pytest.raises(error):
        GenerateOptions(tools=[tool])


def test_a_tool_choice_that_is_no_choice_is_refused() -> None:
    with pytest.raises(ValueError, match="tool_choice must be"):
        build_generate_request(None, QUESTION, None, GenerateOptions(tools=OPENAI_TOOLS, tool_choice="always"))  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------- real server


@pytest.fixture(scope="module")
def client(server_address: str) -> Any:
    with Client(server_address, timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def required_events(client: Client) -> list[GenerateEvent]:
    """One answer with tool_choice="required", streamed (shared by the tests below)."""
    return list(
        client.generate(
            messages=QUESTION, tools=OPENAI_TOOLS, tool_choice="required", parallel_tool_calls=False, max_new_tokens=60
        )
    )


def test_required_calls_come_back_streamed_and_aggregated_and_validate(required_events: list[GenerateEvent]) -> None:
    last = required_events[-1]
    assert last.finish_reason is FinishReason.TOOL_CALLS and last.tool_calls, last
    assert all(not e.tool_calls for e in required_events[:-1])  # the calls come with the last event only
    for call in last.tool_calls:
        assert call.id.startswith("call_") and call.name in SCHEMAS
        jsonschema.validate(call.parsed_arguments(), SCHEMAS[call.name])
    builder = ResultBuilder()  # what generate_text and chat aggregate the events with
    for event in required_events:
        builder.add(event)
    result = builder.result()
    assert result is not None and result.finish_reason is FinishReason.TOOL_CALLS
    assert result.tool_calls == last.tool_calls
    assert result.text == "".join(e.text for e in required_events)


def test_a_named_function_is_the_one_called_with_valid_arguments(client: Client) -> None:
    tools = [Tool.from_openai(t) for t in OPENAI_TOOLS]
    result = client.chat(
        QUESTION, tools=tools, tool_choice=FunctionChoice("get_time"), parallel_tool_calls=False, max_new_tokens=60
    )
    (call,) = result.tool_calls
    assert call.name == "get_time" and result.finish_reason is FinishReason.TOOL_CALLS
    jsonschema.validate(call.parsed_arguments(), TIME_PARAMS)
    with pytest.raises(InvalidRequestError, match="not one of the tools"):
        client.chat(QUESTION, tools=tools, tool_choice=FunctionChoice("get_news"))
    with pytest.raises(InvalidRequestError, match="tools need chat input"):
        client.generate_text("Weather?", tools=tools)


def test_a_history_with_a_call_and_its_result_continues_the_conversation(
    client: Client, required_events: list[GenerateEvent]
) -> None:
    builder = ResultBuilder()
    for event in required_events:
        builder.add(event)
    first = builder.result()
    assert first is not None
    (call,) = first.tool_calls
    assert first.message() == ChatMessage("assistant", "", first.tool_calls)
    result_text = "Sunny, 24 degrees"
    history = [*QUESTION, first.message(), ChatMessage("tool", result_text, tool_call_id=call.id, name=call.name)]
    # The result is in the prompt the model sees: the chat template rendered the tool turn.
    rendered = "".join(client.tokenize(history).pieces)
    assert result_text in rendered and call.arguments.replace(" ", "") in rendered.replace(" ", "")
    answer = client.chat(history, tools=OPENAI_TOOLS, tool_choice="none", max_new_tokens=4)
    assert answer.finish_reason in (FinishReason.EOS, FinishReason.LENGTH) and not answer.tool_calls
    assert answer.usage.prompt_tokens == len(client.tokenize(history).ids)  # the call and its result were sent
    # OpenAI-style dicts give the same prompt as the dataclasses.
    as_dicts: list[dict[str, Any]] = [
        {"role": "user", "content": QUESTION[0][1]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "name": call.name, "content": result_text},
    ]
    assert client.tokenize(as_dicts).ids == client.tokenize(history).ids


# As a library sends it: no additionalProperties, no maxLength.
CITY: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def raw_text(events: list[GenerateEvent]) -> str:
    """What the model wrote: its tokens (the text leaves the calls out)."""
    return "".join(t.text for e in events for t in e.tokens)


def test_a_call_repeated_ends_the_answer_and_a_call_cut_off_is_neither_text_nor_a_call(client: Client) -> None:
    repeated = list(client.generate(messages=QUESTION, tools=[CITY], tool_choice="required", max_new_tokens=200))
    assert raw_text(repeated).count("<tool_call>") == 2  # the model made its call again ...
    last = repeated[-1]  # ... and the answer ended there, with the call once
    assert last.finish_reason is FinishReason.TOOL_CALLS and [c.parsed_arguments() for c in last.tool_calls] == [
        {"city": "Rome"}
    ]
    assert "".join(e.text for e in repeated) == ""
    cut = list(client.generate(messages=QUESTION, tools=[CITY], tool_choice="required", max_new_tokens=8))
    assert raw_text(cut).startswith("<tool_call>")
    assert cut[-1].finish_reason is FinishReason.LENGTH and not cut[-1].tool_calls
    assert "".join(e.text for e in cut) == ""


def test_cli_tools_print_the_calls_as_json_lines(server_address: str, tmp_path: Path) -> None:
    tools_file = tmp_path / "tools.json"
    tools_file.write_text(json.dumps(OPENAI_TOOLS))
    base = ("--server", server_address, "generate", "-q", "-p", QUESTION[0][1], "-l", "60", "--tools", str(tools_file))
    proc = run_cli(*base, "--tool-choice", "get_weather", "--no-parallel-tool-calls")
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"id"')]
    (call,) = lines
    assert "<tool_call>" not in proc.stdout  # the parsed call, not the model's markup
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER_PARAMS)
    proc = run_cli(*base, "--tool-choice", "required", "--no-parallel-tool-calls", "--json")
    assert proc.returncode == 0, proc.stderr
    last = json.loads(proc.stdout.splitlines()[-1])
    assert last["finish_reason"] == "tool_calls" and last["tool_calls"]
    for c in last["tool_calls"]:
        jsonschema.validate(json.loads(c["arguments"]), SCHEMAS[c["name"]])
    # A call cut off by the length limit: no markup printed, and no call.
    proc = run_cli(*base[:-4], "-l", "8", "--tools", str(tools_file), "--tool-choice", "required")
    assert proc.returncode == 0 and "<tool_call>" not in proc.stdout and '{"id"' not in proc.stdout, proc.stdout
    proc = run_cli(*base, "--tool-choice", "get_news")
    (line,) = error_lines(proc.stderr)
    assert proc.returncode == 2 and "--tool-choice 'get_news'" in line, line
    proc = run_cli("--server", server_address, "generate", "-q", "-p", "hi", "--tool-choice", "required")
    assert proc.returncode == 2 and "--tool-choice needs --tools" in proc.stderr
