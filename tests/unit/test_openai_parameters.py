"""Which top-level fields a chat or completions body may hold, as OpenAI's API rules: an unknown one is a 400
("Unrecognized request argument supplied: NAME"), while what OpenAI's SDK, LangChain, LiteLLM, instructor and
lm-evaluation-harness send, and vLLM's extras that tokenmill honours, are taken. Each parameter's type is checked
even where its value changes nothing (a body that breaks /openapi.json's description is refused)."""

from __future__ import annotations

from typing import Any

import pytest

from tokenmill_service.front.http.openai_protocol import parse_request
from tokenmill_service.front.http.request_fields import BadRequest

HI = [{"role": "user", "content": "Hi"}]
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
ADD = {"type": "function", "function": {"name": "add", "description": "Add.", "parameters": PERSON}}


def refused(body: dict[str, Any], chat: bool) -> BadRequest:
    with pytest.raises(BadRequest) as err:
        parse_request(body, chat)
    return err.value


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_an_unknown_field_is_refused_by_name_as_openai_does(chat: bool) -> None:
    body = {"messages": HI} if chat else {"prompt": "Hi"}
    err = refused({**body, "max_tokens": 2, "temprature": 0.5, "other": 1}, chat)
    assert str(err) == "Unrecognized request argument supplied: temprature"
    assert (err.param, err.code) == ("temprature", "unknown_parameter")


def test_each_endpoints_own_parameters_are_unknown_to_the_other() -> None:
    assert refused({"prompt": "Hi", "tools": [ADD]}, chat=False).param == "tools"
    assert refused({"prompt": "Hi", "top_logprobs": 2}, chat=False).param == "top_logprobs"
    assert refused({"messages": HI, "suffix": ""}, chat=True).param == "suffix"
    assert refused({"messages": HI, "prompt": "Hi"}, chat=True).param == "prompt"


@pytest.mark.parametrize(
    ("body", "chat"),
    [
        # LangChain's ChatOpenAI: plain, streamed with usage, structured output, tools, a reasoning effort.
        ({"messages": HI, "model": "m", "stream": False, "temperature": 0, "max_completion_tokens": 8}, True),
        ({"messages": HI, "model": "m", "stream": True, "stream_options": {"include_usage": True}}, True),
        (
            {
                "messages": HI,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "Person", "schema": PERSON, "strict": True},
                },
            },
            True,
        ),
        (
            {
                "messages": HI,
                "tools": [ADD],
                "tool_choice": {"type": "function", "function": {"name": "add"}},
                "parallel_tool_calls": False,
            },
            True,
        ),
        ({"messages": HI, "reasoning_effort": "low", "verbosity": "low", "service_tier": "auto"}, True),
        # LiteLLM with a vLLM extra (its extra_body), instructor's JSON mode.
        ({"messages": HI, "model": "m", "max_tokens": 4, "top_k": 5}, True),
        ({"messages": HI, "response_format": {"type": "json_object"}}, True),
        # The openai SDK's neutral values and the fields that change nothing a server does.
        (
            {
                "messages": HI,
                "user": "u",
                "metadata": {"team": "search"},
                "store": False,
                "modalities": ["text"],
                "functions": [],
                "prompt_cache_key": "k",
                "safety_identifier": "s",
                "n": 1,
                "logit_bias": {},
            },
            True,
        ),
        # vLLM's extras: honoured, or at the value that asks for nothing.
        (
            {
                "messages": HI,
                "top_k": 40,
                "min_p": 0.0,
                "repetition_penalty": 1.1,
                "ignore_eos": False,
                "stop_token_ids": [2],
                "skip_special_tokens": True,
                "guided_json": PERSON,
            },
            True,
        ),
        ({"messages": HI, "structured_outputs": {"regex": "[a-z]+"}}, True),
        # lm-evaluation-harness scoring a prompt and generating; the SDK's completions neutral values.
        (
            {
                "model": "m",
                "prompt": [1, 2, 3],
                "temperature": 0,
                "max_tokens": 1,
                "logprobs": 1,
                "seed": 1234,
                "echo": True,
            },
            False,
        ),
        ({"model": "m", "prompt": "Q:", "max_tokens": 8, "temperature": 0, "stop": ["\n"], "seed": 1234}, False),
        ({"prompt": "Hi", "best_of": 1, "suffix": "", "user": "x", "n": 1, "logprobs": None, "top_p": 1}, False),
        ({"prompt": "Hi", "guided_choice": ["yes", "no"], "min_tokens": 0}, False),
    ],
)
def test_what_common_clients_send_is_taken(body: dict[str, Any], chat: bool) -> None:
    parse_request(body, chat)


@pytest.mark.parametrize(
    ("extra", "param", "says"),
    [
        ({"min_p": 0.05}, "min_p", "'min_p' is not supported by tokenmill"),
        ({"use_beam_search": True}, "use_beam_search", "not supported"),
        ({"store": True}, "store", "not supported"),
        ({"web_search_options": {}}, "web_search_options", "not supported"),
    ],
)
def test_what_tokenmill_cannot_honour_is_refused_as_unsupported(extra: dict[str, Any], param: str, says: str) -> None:
    err = refused({"messages": HI, **extra}, chat=True)
    assert says in str(err) and (err.param, err.code) == (param, "unsupported_parameter")


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        # Each was taken (and ignored, or read as something else) before /openapi.json described its type.
        ({"model": 5}, "model"),
        ({"user": 5}, "user"),
        ({"metadata": "team"}, "metadata"),
        ({"messages": [{"role": "user", "content": 0}]}, "messages[0].content"),
        ({"messages": [{"role": "tool", "content": "4", "tool_call_id": 7}]}, "messages"),
        ({"messages": [{"role": "user", "content": "Hi", "name": ["x"]}]}, "messages"),
        ({"stream_options": 0}, "stream_options"),
        ({"logit_bias": {" 5": 1}}, "logit_bias"),
        ({"logit_bias": {"+5": 1}}, "logit_bias"),
        ({"stop_token_ids": [True]}, "stop_token_ids"),
        ({"max_completion_tokens": 4, "max_tokens": "four"}, "max_tokens"),
        ({"tools": [{"type": "function", "function": {"name": "add", "description": 5}}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}], "tool_choice": "none"}, "tools"),
        ({"tool_choice": {"type": "function", "function": 5}}, "tool_choice"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "an order"}}},
            "response_format.json_schema.name",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}},
            "response_format",
        ),
    ],
)
def test_a_parameter_of_the_wrong_type_is_refused_by_name(extra: dict[str, Any], param: str) -> None:
    assert refused({"messages": HI, **extra}, chat=True).param == param


def test_an_integer_written_with_a_zero_fraction_is_that_integer() -> None:
    # JSON Schema (and so /openapi.json's "integer") reads 5.0 as the integer 5: schemathesis sent such bodies.
    body = {"messages": HI, "max_tokens": 5.0, "n": 2.0, "top_k": 40.0, "seed": 7.0}
    request = parse_request(body, chat=True).request
    assert (request.stopping.max_new_tokens, request.n, request.sampling.top_k, request.sampling.seed) == (5, 2, 40, 7)
    assert refused({"messages": HI, "max_tokens": 5.5}, chat=True).param == "max_tokens"
    assert refused({"messages": HI, "max_tokens": float("inf")}, chat=True).param == "max_tokens"
