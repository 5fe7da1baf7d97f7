"""/openapi.json describes every route the HTTP API serves, in valid JSON Schema, and each body's description names
exactly the fields its parser reads (a chat or completions field read but not described would be refused as
unknown, one described but not read would be a lie), with the bounds it enforces."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import jsonschema
import pytest
from starlette.routing import Route

from tokenmill_service.front.generation import GenerationService
from tokenmill_service.front.http import anthropic_schema, embeddings_schema, responses_schema
from tokenmill_service.front.http.anthropic_protocol import parse_messages
from tokenmill_service.front.http.embeddings_protocol import parse_embeddings
from tokenmill_service.front.http.http_api import HttpApi
from tokenmill_service.front.http.openai_protocol import parameters, parse_request
from tokenmill_service.front.http.openai_schema import request_schema
from tokenmill_service.front.http.openapi import document
from tokenmill_service.front.http.responses_protocol import parse_responses
from tokenmill_service.front.validation import MAX_CHOICES, MAX_STOP_STRING_LENGTH, Limits

LIMITS = Limits(context_length=8192, vocab_size=49152, max_new_tokens=4096, max_top_logprobs=20, max_stop_strings=16)


def served_routes() -> set[tuple[str, str]]:
    app = HttpApi(cast(GenerationService, None)).app  # (the routes only: no request is served)
    return {
        (method, route.path)
        for route in app.routes
        if isinstance(route, Route)
        for method in route.methods or ()
        if method != "HEAD"  # (starlette adds HEAD to every GET)
    }


def test_every_route_served_is_described_and_every_route_described_is_served() -> None:
    described = {(method.upper(), path) for path, ops in document(LIMITS, "1")["paths"].items() for method in ops}
    assert described == served_routes()


def test_every_schema_in_the_document_is_valid_json_schema() -> None:
    doc = document(LIMITS, "1")
    assert doc["openapi"].startswith("3.1")
    found = 0

    def walk(node: Any) -> None:
        nonlocal found
        if isinstance(node, dict):
            if isinstance(node.get("schema"), dict):
                jsonschema.Draft202012Validator.check_schema(node["schema"])
                found += 1
            for value in node.values():
                walk(value)

    walk(doc["paths"])
    for schema in doc["components"]["schemas"].values():
        jsonschema.Draft202012Validator.check_schema(schema)
    assert found > 20


def test_each_example_body_is_valid_and_taken_by_its_parser() -> None:
    parsers = {
        "/v1/chat/completions": lambda body: parse_request(body, chat=True),
        "/v1/completions": lambda body: parse_request(body, chat=False),
        "/v1/messages": parse_messages,
        "/v1/messages/count_tokens": lambda body: parse_messages(body, count_only=True),
        "/v1/responses": parse_responses,
    }
    found = set()
    for path, ops in document(LIMITS, "1")["paths"].items():
        content = ops.get("post", {}).get("requestBody", {}).get("content", {}).get("application/json", {})
        for example in content.get("examples", {}).values():
            jsonschema.Draft202012Validator(content["schema"]).validate(example["value"])
            parsers[path](example["value"])
            found.add(path)
    assert found == set(parsers)


class Reads(dict[str, Any]):
    """A body that notes every field the parser looks at."""

    def __init__(self, body: dict[str, Any]) -> None:
        super().__init__(body)
        self.read: set[str] = set()

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)

    def __contains__(self, key: object) -> bool:
        self.read.add(str(key))
        return super().__contains__(key)

    def __getitem__(self, key: str) -> Any:
        self.read.add(key)
        return super().__getitem__(key)


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_a_body_is_described_by_exactly_the_fields_the_parser_reads(chat: bool) -> None:
    body = Reads({"messages": [{"role": "user", "content": "Hi"}]} if chat else {"prompt": "Hi"})
    parse_request(body, chat)
    described = set(request_schema(LIMITS, chat)["properties"])
    assert described == parameters(chat) == body.read


HI = [{"role": "user", "content": "Hi"}]
# Each other API's route: its parser, a body it takes, and its body's description.
DIALECTS: dict[str, tuple[Callable[[Any], object], dict[str, Any], dict[str, Any]]] = {
    "messages": (parse_messages, {"max_tokens": 5, "messages": HI}, anthropic_schema.request_schema(LIMITS)),
    "count_tokens": (
        lambda body: parse_messages(body, count_only=True),
        {"messages": HI},
        anthropic_schema.request_schema(LIMITS, count_only=True),
    ),
    "responses": (parse_responses, {"input": "Hi"}, responses_schema.request_schema(LIMITS)),
    "embeddings": (parse_embeddings, {"input": "Hi"}, embeddings_schema.request_schema(LIMITS)),
}


@pytest.mark.parametrize("route", DIALECTS)
def test_another_apis_body_is_described_by_exactly_the_fields_its_parser_reads(route: str) -> None:
    parse, minimal, schema = DIALECTS[route]
    body = Reads(minimal)
    parse(body)
    assert set(schema["properties"]) == body.read
    jsonschema.Draft202012Validator(schema).validate(minimal)


def test_the_bounds_described_are_the_ones_enforced() -> None:
    chat = request_schema(LIMITS, chat=True)["properties"]
    assert chat["n"]["maximum"] == MAX_CHOICES
    assert chat["max_tokens"]["maximum"] == chat["max_completion_tokens"]["maximum"] == LIMITS.max_new_tokens
    assert chat["top_logprobs"]["maximum"] == LIMITS.max_top_logprobs
    assert chat["stop_token_ids"]["items"]["maximum"] == LIMITS.vocab_size - 1
    # A body just past each bound fails the description, and so does the unknown field.
    validator = jsonschema.Draft202012Validator(request_schema(LIMITS, chat=True))
    base: dict[str, Any] = {"messages": [{"role": "user", "content": "Hi"}]}
    assert validator.is_valid({**base, "n": MAX_CHOICES, "presence_penalty": 2, "logit_bias": {"7": -100}})
    for past in ({"n": MAX_CHOICES + 1}, {"presence_penalty": 2.5}, {"logit_bias": {" 7": 1}}, {"foo": 1}):
        assert not validator.is_valid({**base, **past}), past


def test_the_other_apis_bounds_are_the_chat_paths() -> None:
    messages = anthropic_schema.request_schema(LIMITS)["properties"]
    assert messages["max_tokens"]["maximum"] == LIMITS.max_new_tokens
    assert messages["stop_sequences"]["type"] == ["array", "null"]
    assert messages["stop_sequences"]["maxItems"] == LIMITS.max_stop_strings
    assert messages["stop_sequences"]["items"]["maxLength"] == MAX_STOP_STRING_LENGTH
    responses = responses_schema.request_schema(LIMITS)["properties"]
    assert responses["max_output_tokens"]["maximum"] == LIMITS.max_new_tokens
    chat = request_schema(LIMITS, chat=True)["properties"]
    assert messages["temperature"] == responses["temperature"] == chat["temperature"]
    base: dict[str, Any] = {"max_tokens": 5, "messages": HI}
    validator = jsonschema.Draft202012Validator(anthropic_schema.request_schema(LIMITS))
    assert validator.is_valid({**base, "max_tokens": LIMITS.max_new_tokens, "stop_sequences": ["x"] * 16})
    for past in (
        {"max_tokens": LIMITS.max_new_tokens + 1},
        {"stop_sequences": ["x"] * 17},
        {"stop_sequences": "END"},
        {"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "1", "name": "f"}]}]},
        {"tools": [{"name": "bad name!", "input_schema": {}}]},
    ):
        assert not validator.is_valid({**base, **past}), past
