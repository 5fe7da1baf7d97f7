"""Tool calls read back from a model's own syntax, per family, and a stream's text held back from a call."""

from __future__ import annotations

import json
from typing import Any

from tokenmill_service.contract.chat.tool_calls import (
    FAMILIES,
    HeldText,
    Tool,
    call_grammar,
    call_text,
    family_for,
    parse_calls,
    repeats_a_call,
    start_marker,
)

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
    two = call_text("f", '{"a": 2}', LLAMA)
    _, calls = parse_calls(f"{one}; {two}", LLAMA)
    assert [(c.name, c.arguments) for c in calls] == [("f", '{"a": 1}'), ("f", '{"a": 2}')]
    assert parse_calls('The answer is {"name": "f", "parameters": {}}', LLAMA)[1] == []


def test_the_family_comes_from_the_chat_template() -> None:
    assert family_for(None) is HERMES
    assert family_for("{{ '<|python_tag|>' }}") is LLAMA
    assert start_marker(HERMES) == "<tool_call>" and start_marker(LLAMA) == "{"


def test_a_call_made_again_with_the_same_arguments_is_read_once() -> None:
    weather, add = call_text("w", '{"city": "Rome"}', HERMES), call_text("add", '{"a": 1}', HERMES)
    _, calls = parse_calls(f"{weather}\n{weather}\n{add}\n{weather}", HERMES)
    assert [(c.name, c.arguments) for c in calls] == [("w", '{"city": "Rome"}'), ("add", '{"a": 1}')]
    assert repeats_a_call(f"{weather}\n{add}\n{weather}", HERMES)
    assert not repeats_a_call(f"{weather}\n{add}\n<tool_call>\n" + weather.split("\n")[1][:-2], HERMES)


def test_a_stream_holds_back_text_that_may_open_a_call() -> None:
    held = HeldText(HERMES)
    assert held.add("Sure <tool") == "Sure "
    assert held.add("_call>\n{") == ""
    assert held.end(read_calls=False, ended_by_itself=True) == "<tool_call>\n{"  # the model's text, not a call
    held = HeldText(HERMES)
    assert held.add("a <to") == "a " and held.add("o much") == "<too much"
    assert held.end(read_calls=False, ended_by_itself=False) == ""


def test_a_call_cut_off_or_read_is_never_shown_as_text() -> None:
    for read, by_itself in ((False, False), (True, True), (True, False)):
        held = HeldText(HERMES)
        assert held.add('Let me check.\n<tool_call>\n{"name": "w", "argu') == "Let me check.\n"
        assert held.add('ments": {}}\n</tool_call>') == ""
        assert held.end(read_calls=read, ended_by_itself=by_itself) == ""


def test_a_call_that_is_the_whole_answer_is_held_only_at_its_start() -> None:
    held = HeldText(LLAMA)
    assert held.add("  ") == "" and held.add('{"name": "f"') == ""
    assert held.end(read_calls=False, ended_by_itself=False) == ""
    held = HeldText(LLAMA)
    assert held.add("The answer is {") == "The answer is {" and held.add("x}") == "x}"
    assert held.end(read_calls=False, ended_by_itself=False) == ""


def test_the_call_grammar_admits_only_calls_whose_arguments_validate(default_tokenizer: Any) -> None:
    from tokenmill_service.contract.grammar import GrammarCompiler
    from tokenmill_service.contract.request import Constraint

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


def test_a_named_function_or_no_parallel_calls_admit_one_call_then_the_end(default_tokenizer: Any) -> None:
    """One call, then only the end: the grammar leaves no room for a second (SmolLM2 wrote the same call
    two or three times when it could); several calls may end with a line break or without one."""
    from tokenmill_service.contract.grammar import GrammarCompiler
    from tokenmill_service.contract.request import Constraint

    add = Tool("add", "", {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    compiler = GrammarCompiler(default_tokenizer)
    one = call_text("add", '{"a": 1}', HERMES)
    single = compiler.matcher(Constraint("grammar", call_grammar([add], HERMES, parallel=False), "lark"))
    assert single.consume_tokens(default_tokenizer.encode(one)) and single.is_stopped()
    ids = default_tokenizer.encode(one + "\n" + one)
    assert compiler.matcher(Constraint("grammar", call_grammar([add], HERMES, parallel=False), "lark")).validate_tokens(
        ids
    ) < len(ids)
    for text in (one + "\n", one + "\n" + call_text("add", '{"a": 2}', HERMES) + "\n"):
        several = compiler.matcher(Constraint("grammar", call_grammar([add], HERMES, parallel=True), "lark"))
        assert several.consume_tokens(default_tokenizer.encode(text)) and several.is_accepting(), text


def test_forced_arguments_hold_only_the_keys_their_schema_declares(default_tokenizer: Any) -> None:
    from tokenmill_service.contract.grammar import GrammarCompiler
    from tokenmill_service.contract.request import Constraint

    weather = Tool("w", "", {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
    bare = Tool("now", "", {"type": "object", "properties": {}})
    compiler = GrammarCompiler(default_tokenizer)
    for tool, extra in ((weather, '{"city": "Rome", "country": "Italy"}'), (bare, '{"x": 1}')):
        ids = default_tokenizer.encode(call_text(tool.name, extra, HERMES))
        strict = compiler.matcher(Constraint("grammar", call_grammar([tool], HERMES, parallel=False), "lark"))
        assert strict.validate_tokens(ids) < len(ids)
        open_ = compiler.matcher(Constraint("grammar", call_grammar([tool], HERMES, False, permissive=True), "lark"))
        assert open_.consume_tokens(ids) and open_.is_accepting()
