"""A JSON schema's silences about extra keys and items read as "nothing more than it declares", as xgrammar's
strict mode reads them: the schemas pydantic makes (which instructor, LangChain and the openai SDK send),
the cases xgrammar keeps open, and what the compiled grammar then admits."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from pydantic import BaseModel

from tokenmill_service.contract.closed_schema import close_schema


class Address(BaseModel):
    city: str


class Person(BaseModel):
    name: str
    age: int
    address: Address
    tags: list[str]
    extra: dict[str, int]
    alias: str | None = None


def test_every_object_a_pydantic_model_declares_admits_only_its_fields() -> None:
    schema = Person.model_json_schema()
    closed = close_schema(copy.deepcopy(schema))
    assert closed["additionalProperties"] is False
    assert closed["$defs"]["Address"]["additionalProperties"] is False
    # What the model says itself is kept: a dict field's open values, a list's items.
    assert closed["properties"]["extra"]["additionalProperties"] == {"type": "integer"}
    assert closed["properties"]["tags"]["items"] == {"type": "string"}
    assert closed["properties"]["alias"] == schema["properties"]["alias"]


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object"},  # any object (json_object's, and xgrammar's)
        {"type": "object", "description": "anything"},
        {"type": "array"},  # any array
        {"type": "array", "title": "Things"},
        {"type": "object", "properties": {"a": {}}, "additionalProperties": True},
        {"type": "object", "properties": {"a": {}}, "additionalProperties": {"type": "integer"}},
        {"type": "array", "items": {"type": "integer"}},
        {"type": "integer", "default": {"properties": {"a": 1}}},  # a value, not a schema
        {"enum": [{"properties": {}}], "const": {"type": "array", "minItems": 1}},
    ],
)
def test_what_xgrammar_keeps_open_and_what_a_schema_says_itself_stays(schema: dict[str, Any]) -> None:
    assert close_schema(copy.deepcopy(schema)) == schema


def test_an_array_without_items_admits_only_its_prefix_items() -> None:
    assert close_schema({"type": "array", "maxItems": 3}) == {"type": "array", "maxItems": 3, "items": False}
    pair = {"prefixItems": [{"type": "integer"}, {"type": "object", "properties": {"a": {}}}]}
    closed = close_schema(copy.deepcopy(pair))
    assert closed["items"] is False and closed["prefixItems"][1]["additionalProperties"] is False


def test_a_required_key_that_is_not_described_is_declared_all_the_same() -> None:
    closed = close_schema({"properties": {"a": {"type": "integer"}}, "required": ["a", "b"]})
    assert closed == {
        "properties": {"a": {"type": "integer"}, "b": True},
        "required": ["a", "b"],
        "additionalProperties": False,
    }


def test_the_parts_of_an_intersection_keep_their_own_reading() -> None:
    a, b = {"properties": {"a": {}}}, {"properties": {"b": {"properties": {"c": {}}}}}
    closed = close_schema({"allOf": [copy.deepcopy(a), copy.deepcopy(b)]})
    assert "additionalProperties" not in closed["allOf"][0] and "additionalProperties" not in closed["allOf"][1]
    assert closed["allOf"][1]["properties"]["b"]["additionalProperties"] is False  # (its own object)
    beside_ref = {"$ref": "#/$defs/A", "properties": {"x": {}}}
    assert close_schema(copy.deepcopy(beside_ref)) == beside_ref
    assert close_schema({"allOf": [copy.deepcopy(a)]})["allOf"][0]["additionalProperties"] is False
    for key in ("anyOf", "oneOf"):
        assert all(o["additionalProperties"] is False for o in close_schema({key: [copy.deepcopy(a), b]})[key])


def test_the_grammar_refuses_an_extra_key_unless_permissive(default_tokenizer: Any) -> None:
    from tokenmill_service.contract.grammar import ConstraintError, GrammarCompiler
    from tokenmill_service.contract.request import Constraint

    compiler = GrammarCompiler(default_tokenizer)
    schema = json.dumps(Person.model_json_schema())
    answer = '{"name": "Al", "age": 3, "address": {"city": "Rome"}, "tags": [], "extra": {}'
    for extra, permissive in ((', "nickname": "A"}', False), ("}", False), (', "nickname": "A"}', True)):
        ids = default_tokenizer.encode(answer + extra)
        matcher = compiler.matcher(Constraint("json_schema", schema, permissive=permissive))
        admitted = matcher.validate_tokens(ids) == len(ids)
        assert admitted == (extra == "}" or permissive), (extra, permissive)
    # Closed, an array that must hold items it does not describe admits nothing: the refusal says why.
    with pytest.raises(ConstraintError, match="without items only its prefixItems"):
        compiler.matcher(Constraint("json_schema", json.dumps({"type": "array", "minItems": 1})))
    compiler.matcher(Constraint("json_schema", json.dumps({"type": "array", "minItems": 1}), permissive=True))
