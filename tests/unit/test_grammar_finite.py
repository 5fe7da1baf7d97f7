"""Constraints that admit no finite text are found (a JSON schema whose values must each hold another, a grammar
whose start rule never ends), and nothing that can end is: the project's fifty-odd schemas, recursive ones with
a way out, optional and zero-count repetitions."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import llguidance as llg
import pytest

from tokenmill_service.contract.grammar_finite import endless_rules, unproductive_refs

DATA = Path(__file__).parents[1] / "data" / "json_schemas.json"
NODE = {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}, "required": ["next"]}


@pytest.mark.parametrize(
    ("schema", "refs"),
    [
        ({"$defs": {"n": NODE}, "$ref": "#/$defs/n"}, ["#/$defs/n"]),
        ({"type": "object", "properties": {"me": {"$ref": "#"}}, "required": ["me"]}, ["#"]),
        ({"type": "array", "items": {"$ref": "#"}, "minItems": 1}, ["#"]),
        ({"type": "array", "prefixItems": [{"$ref": "#"}], "minItems": 1}, ["#"]),
        # Through two definitions, and through allOf.
        (
            {
                "$defs": {
                    "a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}}, "required": ["b"]},
                    "b": {"allOf": [{"$ref": "#/$defs/a"}]},
                },
                "$ref": "#/$defs/a",
            },
            ["#/$defs/a", "#/$defs/b"],
        ),
    ],
)
def test_a_schema_whose_every_value_holds_another_is_found(schema: dict[str, Any], refs: list[str]) -> None:
    assert unproductive_refs(schema) == refs


@pytest.mark.parametrize(
    "schema",
    [
        {"$defs": {"n": {**NODE, "required": []}}, "$ref": "#/$defs/n"},  # next is optional
        {"$defs": {"n": {"anyOf": [{"type": "null"}, NODE]}}, "$ref": "#/$defs/n"},  # null ends it
        {
            "$defs": {"n": {"type": ["object", "null"], **{k: NODE[k] for k in ("properties", "required")}}},
            "$ref": "#/$defs/n",
        },
        {"type": "array", "items": {"$ref": "#"}},  # [] ends it
        {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}, "required": ["kids"]},
        {"properties": {"me": {"$ref": "#"}}, "required": ["me"]},  # no type: a string will do
        {"type": "object", "properties": {"x": {"$ref": "https://example.com/s.json"}}, "required": ["x"]},
        {"type": "object", "properties": {"x": {"$ref": "#/nowhere"}}, "required": ["x"]},
        True,
    ],
)
def test_a_schema_with_a_way_out_is_not(schema: Any) -> None:
    assert unproductive_refs(schema) is None


def test_none_of_the_projects_schemas_is_refused() -> None:
    cases = json.loads(DATA.read_text())["schemas"]
    assert len(cases) > 40
    for case in cases:
        assert unproductive_refs(case["schema"]) is None, case["name"]


@pytest.mark.parametrize(
    ("grammar", "rules"),
    [
        ('start: "a" start', ["start"]),
        ('start: a\na: "x" a\n  | "y" a', ["start", "a"]),
        ('start: ("a" start)+', ["start"]),
        ('start: x\nx: "a" ~ 2 x  // two at a time, for ever', ["start", "x"]),
        ("start: WS start\n%import common.WS", ["start"]),
        ('start: "<" %json {"type": "array", "items": {"$ref": "#"}, "minItems": 2} ">"', ["start"]),
        (llg.grammar_from("gbnf", 'root ::= "a" x\nx ::= "b" x'), ["start", "x"]),
    ],
)
def test_a_grammar_whose_start_never_ends_is_found(grammar: str, rules: list[str]) -> None:
    assert endless_rules(grammar) == rules


@pytest.mark.parametrize(
    "grammar",
    [
        'start: "a" b\nb: "b" b | "c"',
        'start: ("a" start)*',
        'start: "a" start?',
        'start: [start] "a"',
        'start: "a" start{0,3} "b"',
        'start: "x" // start',
        "start: /[a-z]+/ start\n  | NAME\nNAME: /[A-Z]+/",
        llg.grammar_from("gbnf", 'root ::= "a" root | "b"'),
        'start: "a" start | other\nother: "b"',
        # What the reader does not follow counts as able to end.
        "start: a?b\na: start",
        'start: _sep{"a", ","}\n_sep{x, sep}: x (sep x)*',
    ],
)
def test_a_grammar_that_can_end_is_not(grammar: str) -> None:
    assert endless_rules(grammar) is None
