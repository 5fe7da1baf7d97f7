"""A constraint in a harmony chat holds the final channel's text: the grammar engine's matcher, over a tokenizer
with harmony's control tokens, admits an optional analysis message and the final header around it, and
nothing else; which requests get it is the validation's choice."""

from __future__ import annotations

import json

import llguidance as llg
import pytest

from tests.tiny_checkpoint import write_byte_level_tokenizer
from tokenmill_service.contract.chat.harmony_constraint import CONTROL_TOKENS
from tokenmill_service.contract.grammar import GrammarCompiler
from tokenmill_service.contract.request import Constraint
from tokenmill_service.contract.tokenizer import Tokenizer
from tokenmill_service.contract.tokenizer.load import load_tokenizer
from tokenmill_service.front.proto import pb
from tokenmill_service.front.validation import _constraint_or_tool_call

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}
# Each kind of constraint, a text it admits and one it refuses.
CASES = [
    (Constraint("json_schema", json.dumps(SCHEMA)), '{"n": 5}', '{"m": 5}'),
    (Constraint("json_object"), '{"k": [1, 2]}', "[1, 2]"),
    (Constraint("regex", "[a-c]{2}x"), "abx", "abcx"),
    (Constraint("grammar", 'start: "yes" | "no"', "lark"), "no", "maybe"),
    (Constraint("grammar", 'root ::= "yes" | "no"', "gbnf"), "yes", "nope"),
]
FINAL = "<|channel|>final<|message|>"
ANALYSIS = "<|channel|>analysis<|message|>Let me see.\nOK.<|end|><|start|>assistant"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    directory = tmp_path_factory.mktemp("harmony-tokens")
    write_byte_level_tokenizer(directory, *CONTROL_TOKENS)
    tok = load_tokenizer(directory)
    assert tok.harmony
    return tok


def ids(tokenizer: Tokenizer, text: str) -> list[int]:
    """The ids of text whose control tokens are written out."""
    out: list[int] = []
    for piece in text.replace("<|", "\0<|").replace("|>", "|>\0").split("\0"):
        special = tokenizer.special_id(piece) if piece.startswith("<|") else None
        out += [special] if special is not None else tokenizer.encode(piece) if piece else []
    return out


def admits(matcher: llg.LLMatcher, tokens: list[int]) -> bool:
    """Whether the matcher takes these tokens and then stops (the last one being a stop token)."""
    m = matcher.deep_copy()
    return m.consume_tokens(tokens) and not m.is_error() and m.is_stopped()


@pytest.mark.parametrize(("constraint", "good", "bad"), CASES, ids=[c.kind + c.syntax for c, _, _ in CASES])
def test_the_final_channels_text_is_what_the_constraint_admits(
    tokenizer: Tokenizer, constraint: Constraint, good: str, bad: str
) -> None:
    matcher = GrammarCompiler(tokenizer).matcher(Constraint(constraint.kind, constraint.text, constraint.syntax, True))
    for before in ("", ANALYSIS):
        assert admits(matcher, ids(tokenizer, f"{before}{FINAL}{good}<|return|>"))
        assert not admits(matcher, ids(tokenizer, f"{before}{FINAL}{bad}<|return|>"))
    # Not bare text, nor the text in another channel, nor a turn that ends otherwise.
    assert not admits(matcher, [*tokenizer.encode(good), tokenizer.special_id("<|return|>")])
    assert not admits(matcher, ids(tokenizer, f"<|channel|>commentary<|message|>{good}<|return|>"))
    assert not admits(matcher, ids(tokenizer, f"{FINAL}{good}<|call|>"))
    # Outside a harmony chat the constraint is the bare text, as ever.
    plain = GrammarCompiler(tokenizer).matcher(constraint)
    assert admits(plain, [*tokenizer.encode(good), tokenizer.special_id("<|return|>")])


def test_a_harmony_chats_constraint_holds_the_final_text_unless_a_grammar_writes_the_headers(
    tokenizer: Tokenizer, default_tokenizer: Tokenizer
) -> None:
    chat = pb.Messages(messages=[pb.ChatMessage(role="user", content="Hi")])
    whole = '<|channel|> "final" <|message|> "Hi." <|return|>'
    regex = _constraint_or_tool_call(pb.GenerateRequest(chat=chat, regex="a+"), tokenizer)
    grammar = pb.Grammar(text=whole, syntax=pb.GRAMMAR_SYNTAX_LARK)
    headers = _constraint_or_tool_call(pb.GenerateRequest(chat=chat, grammar=grammar), tokenizer)
    prompt = _constraint_or_tool_call(pb.GenerateRequest(prompt="Hi", regex="a+"), tokenizer)
    other = _constraint_or_tool_call(pb.GenerateRequest(chat=chat, regex="a+"), default_tokenizer)
    assert regex == Constraint("regex", "a+", "", harmony=True)
    assert headers == Constraint("grammar", whole, "lark")
    assert prompt == other == Constraint("regex", "a+")
