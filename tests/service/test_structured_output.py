"""Structured output through the gRPC API: constraints (JSON schema, any JSON object, regex, Lark and GBNF
grammars) against the shared default server, their refusals, and bit-for-bit invariance in a crowd."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator

import grpc
import jsonschema
import pytest

from tests.server_process import ServerProcess
from tests.streams import trace
from tokenmill_client._proto import generate_pb2 as pb
from tokenmill_client._proto import generate_pb2_grpc as pb_grpc

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


def chat(text: str) -> pb.Messages:
    return pb.Messages(messages=[pb.ChatMessage(role="user", content=text)])


@pytest.fixture(scope="module")
def stub(server: ServerProcess) -> Iterator[pb_grpc.GenerationStub]:
    with grpc.insecure_channel(server.address) as channel:
        yield pb_grpc.GenerationStub(channel)


def generate(stub: pb_grpc.GenerationStub, request: pb.GenerateRequest) -> tuple[str, list[pb.GenerateResponse]]:
    replies = list(stub.Generate(request, timeout=300))
    return "".join(r.text for r in replies), replies


def test_a_json_schema_gives_valid_json_that_ends_with_the_schema(stub: pb_grpc.GenerationStub) -> None:
    request = pb.GenerateRequest(
        chat=chat("Describe a person as JSON."),
        json_schema=json.dumps(PERSON),
        stopping=pb.StoppingParams(max_new_tokens=80),
    )
    text, replies = generate(stub, request)
    jsonschema.validate(json.loads(text), PERSON)
    assert replies[-1].finish_reason == pb.FINISH_REASON_EOS
    assert replies[-1].usage.completion_tokens == sum(len(r.tokens) for r in replies)


def test_json_object_regex_and_grammars_constrain_the_text(stub: pb_grpc.GenerationStub) -> None:
    obj, _ = generate(
        stub,
        pb.GenerateRequest(
            chat=chat("A JSON object please."),
            json_object=pb.JsonObject(),
            stopping=pb.StoppingParams(max_new_tokens=40),
            sampling=pb.SamplingParams(temperature=0.7, seed=5),
        ),
    )
    assert obj.startswith("{")
    pattern = r"(19|20)[0-9]{2}-[01][0-9]-[0-3][0-9]"
    date, _ = generate(
        stub,
        pb.GenerateRequest(
            chat=chat("When was the moon landing?"), regex=pattern, stopping=pb.StoppingParams(max_new_tokens=12)
        ),
    )
    assert re.fullmatch(pattern, date), date
    lark = pb.Grammar(text='start: answer "."\nanswer: "yes" | "no" | "maybe"', syntax=pb.GRAMMAR_SYNTAX_LARK)
    answer, replies = generate(stub, pb.GenerateRequest(chat=chat("Is the sky blue?"), grammar=lark))
    assert answer in ("yes.", "no.", "maybe.") and replies[-1].finish_reason == pb.FINISH_REASON_EOS
    gbnf = pb.Grammar(text='root ::= [a-z]{1,12} " " [0-9]{1,3}', syntax=pb.GRAMMAR_SYNTAX_GBNF)
    words, _ = generate(
        stub, pb.GenerateRequest(prompt="Name and number:", grammar=gbnf, stopping=pb.StoppingParams(max_new_tokens=12))
    )
    assert re.fullmatch(r"[a-z]{1,12} [0-9]{1,3}", words), words


def test_a_grammar_that_cannot_end_in_time_ends_with_length(stub: pb_grpc.GenerationStub) -> None:
    request = pb.GenerateRequest(
        prompt="Count:", regex="[0-9]{50}", stopping=pb.StoppingParams(max_new_tokens=5), logprobs=True
    )
    text, replies = generate(stub, request)
    assert replies[-1].finish_reason == pb.FINISH_REASON_LENGTH and text.isdigit()
    # Logprobs are the model's own: a masked token's logprob is below zero, never renormalized to 0.
    assert all(t.logprob <= 0 for r in replies for t in r.tokens)


@pytest.mark.parametrize(
    ("request_fields", "message"),
    [
        ({"json_schema": "{not json"}, "json_schema: the JSON schema is not valid JSON"),
        ({"json_schema": '{"type": "strin"}'}, "json_schema: the json_schema cannot be used"),
        ({"json_schema": '{"type": "string", "format": "no-such-format"}'}, "json_schema: the json_schema cannot"),
        ({"regex": "(unclosed"}, "regex: the regex cannot be used"),
        ({"grammar": pb.Grammar(text="start: missing_rule")}, "grammar.text: the grammar cannot be used"),
        ({"grammar": pb.Grammar(text="root ::= (", syntax=pb.GRAMMAR_SYNTAX_GBNF)}, "grammar.text:"),
        ({"regex": " "}, "regex is empty"),
    ],
)
def test_a_constraint_that_cannot_be_used_is_invalid_argument_before_any_token(
    stub: pb_grpc.GenerationStub, request_fields: dict[str, object], message: str
) -> None:
    request = pb.GenerateRequest(prompt="Hello", **request_fields)  # type: ignore[arg-type]
    with pytest.raises(grpc.RpcError) as err:
        generate(stub, request)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in (err.value.details() or ""), err.value.details()


def test_model_info_reports_the_constraint_limits(stub: pb_grpc.GenerationStub) -> None:
    limits = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30).limits
    assert limits.max_constraint_length > 0 and limits.constraint_compile_timeout_s > 0


def crowd() -> list[pb.GenerateRequest]:
    """15 requests around the ones compared: constrained and not, greedy and seeded, some with long prompts
    (prefilled in chunks while the others decode)."""
    out = []
    for i in range(15):
        r = pb.GenerateRequest(stopping=pb.StoppingParams(max_new_tokens=8 + i), logprobs=True)
        r.prompt = f"Note {i}: " + " ".join(f"item {j} is fine;" for j in range(120 if i % 7 == 0 else 3))
        if i % 3 == 0:
            r.json_object.SetInParent()
        elif i % 3 == 1:
            r.json_schema = json.dumps(PERSON)
        if i % 2:
            r.sampling.temperature, r.sampling.seed = 0.9, 100 + i
        out.append(r)
    return out


def test_constrained_requests_give_the_same_tokens_and_logprobs_alone_and_in_a_crowd(server: ServerProcess) -> None:
    targets = [
        pb.GenerateRequest(
            chat=chat("Describe a person as JSON."),
            json_schema=json.dumps(PERSON),
            logprobs=True,
            top_logprobs=3,
            stopping=pb.StoppingParams(max_new_tokens=40),
        ),
        pb.GenerateRequest(
            chat=chat("Write a date."),
            regex=r"[0-9]{4}-[0-9]{2}-[0-9]{2}( and [0-9]{4}-[0-9]{2}-[0-9]{2})*",
            sampling=pb.SamplingParams(temperature=1.0, seed=7),
            stopping=pb.StoppingParams(max_new_tokens=24),
            logprobs=True,
        ),
    ]

    async def run() -> tuple[list[object], list[object]]:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            alone = [await trace(stub, t) for t in targets]
            together = await asyncio.gather(*(trace(stub, r) for r in [*targets, *crowd()]))
            return list(alone), list(together[: len(targets)])

    alone, together = asyncio.run(run())
    for i, (a, b) in enumerate(zip(alone, together)):
        assert a and a == b, f"target {i}: the crowd changed its tokens or logprobs"


def test_grpc_tools_a_forced_call_comes_back_parsed_with_finish_reason_tool_calls(stub: pb_grpc.GenerationStub) -> None:
    params = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}
    request = pb.GenerateRequest(
        chat=chat("Weather in Rome?"),
        tools=[pb.Tool(name="get_weather", description="The weather in a city.", parameters=json.dumps(params))],
        tool_choice=pb.TOOL_CHOICE_FUNCTION,
        tool_choice_function="get_weather",
        parallel_tool_calls=False,
        stopping=pb.StoppingParams(max_new_tokens=40),
    )
    text, replies = generate(stub, request)
    last = replies[-1]
    assert last.finish_reason == pb.FINISH_REASON_TOOL_CALLS and len(last.tool_calls) == 1
    call = last.tool_calls[0]
    # The call's text is the model's (its tokens), never the answer's text.
    assert call.name == "get_weather" and text == ""
    assert "".join(t.text for r in replies for t in r.tokens).startswith("<tool_call>")
    jsonschema.validate(json.loads(call.arguments), params)
    bad = pb.GenerateRequest(prompt="x", tools=[pb.Tool(name="f")])
    with pytest.raises(grpc.RpcError) as err:
        generate(stub, bad)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tools need chat input" in (
        err.value.details() or ""
    )
