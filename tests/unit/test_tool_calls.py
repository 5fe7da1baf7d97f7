"""Tool calls read back from a model's own syntax, per family, and a stream's text held back from a call."""

from __future__ import annotations

import json
from typing import Any

from tokenmill_service.openai_tools import HeldText
from tokenmill_service.tool_calls import FAMILIES, Tool, call_grammar, call_text, family_for, parse_calls, start_marker

HERMES = FAMILIES["hermes"]
LLAMA = FAMILIES["llama3_json"]


def test_hermes_calls_are_read_with_the_text_before_them() -> None:
    text = 'Let me check.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>'
    content, calls = parse_calls(text, HERMES)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"x": 1}), ("g", {})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)


def test_a_call_cut_short_or_malformed_is_not_a_call() -> None:
    assert parse_calls('<tool_call>\n{"name": "f", "argu', HERMES)[1] == []
    assert parse_calls('<tool_call>\n{"name": 3, "arguments": {}}\n</tool_call>', HERMES)[1] == []
    assert parse_calls("no call here", HERMES) == ("no call here", [])


def test_llama3_json_calls_are_the_whole_answer_joined_by_semicolons() -> None:
    one = call_text("f", '{"a": 1}', LLAMA)
    assert one == '{"name": "f", "parameters": {"a": 1}}'
    _, calls = parse_calls(f"{one}; {one}", LLAMA)
    assert [c.name for c in calls] == ["f", "f"]
    assert parse_calls('The answer is {"name": "f", "parameters": {}}', LLAMA)[1] == []


def test_the_family_comes_from_the_chat_template() -> None:
    assert family_for(None) is HERMES
    assert family_for("{{ '<|python_tag|>' }}") is LLAMA
    assert start_marker(HERMES) == "<tool_call>" and start_marker(LLAMA) == "{"


def test_a_stream_holds_back_text_that_may_open_a_call() -> None:
    held = HeldText("<tool_call>")
    assert held.add("Sure <tool") == "Sure "
    assert held.add("_call>\n{") == ""
    assert held.flush() == "<tool_call>\n{"
    held = HeldText("<tool_call>")
    assert held.add("a <to") == "a " and held.add("o much") == "<too much"


def test_the_call_grammar_admits_only_calls_whose_arguments_validate(default_tokenizer: Any) -> None:
    from tokenmill_service.engine.grammar import GrammarCompiler
    from tokenmill_service.engine.request import Constraint

    add = Tool("add", "", {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    compiler = GrammarCompiler(default_tokenizer)
    for family, parallel in ((HERMES, True), (LLAMA, False)):
        grammar = Constraint("grammar", call_grammar([add], family, parallel), "lark")
        good = call_text("add", '{"a": 1}', family)
        text = good + family.separator + good if parallel else good
        matcher = compiler.matcher(grammar)
        assert matcher.consume_tokens(default_tokenizer.encode(text)) and matcher.is_accepting()
        for bad in (call_text("add", '{"a": "x"}', family), call_text("sub", '{"a": 1}', family)):
            ids = default_tokenizer.encode(bad)
            assert compiler.matcher(grammar).validate_tokens(ids) < len(ids), bad
