"""A constrained answer in the harmony format (gpt-oss): the caller's constraint holds the final channel's text.

A harmony model's answer is messages with headers, not bare text: after the prompt's ``<|start|>assistant``
it writes ``<|channel|>analysis<|message|>...<|end|>`` (its reasoning), then
``<|start|>assistant<|channel|>final<|message|>...<|return|>`` (the answer). A constraint that matched the
answer's tokens from the first one (a JSON schema, a regex) would force bare text with no header, which the
channel reader (harmony.py) takes for a header: the answer would come back empty. So in a harmony chat the
constraint is the final message's text: the grammar admits an optional analysis message, then the final
channel's header, then the constraint's own grammar (as contract/grammar.py builds it, referenced as a
sub-grammar, so its lexer and options are its own), then ``<|return|>``. The forced tool call
(harmony_tools.py) has the same shape, with a call in place of the final message.

A grammar that names harmony's control tokens (``<|channel|>``...) describes the whole answer, headers
included, and is taken as it is.
"""

from __future__ import annotations

import json

# The reasoning an answer may begin with, ending where the next message's header starts (the prompt ended
# with "<|start|>assistant", so the first header starts at <|channel|>; a later one repeats the role).
ANALYSIS_RULES = (
    'analysis: <|channel|> "analysis" <|message|> REASONING <|end|> <|start|> "assistant"\nREASONING: /(.|\\n)*/\n'
)
CONTROL_TOKENS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>")
# The names of the grammars composed (the caller's own is referenced as @ANSWER).
WRAPPER, ANSWER = "harmony_answer", "constrained_final"


def names_control_tokens(grammar: str) -> bool:
    """Whether a caller's grammar spells out harmony's headers itself (then it is the whole answer)."""
    return any(token in grammar for token in CONTROL_TOKENS)


def answer_grammar(inner: str) -> str:
    """llguidance's grammar (a TopLevelGrammar's JSON) admitting an optional analysis message, then the final
    channel whose text ``inner`` admits, then ``<|return|>``. ``inner``: llguidance's grammar text of the
    constraint (a TopLevelGrammar's JSON, or Lark)."""
    if inner.lstrip().startswith("{"):
        top = json.loads(inner)
        grammars = [dict(g) for g in top.get("grammars", [])]
    else:
        top, grammars = {}, [{"lark_grammar": inner}]
    if not grammars:
        raise ValueError("the constraint's grammar holds no grammar")
    grammars[0]["name"] = ANSWER  # the first is the start
    wrapper = {
        "name": WRAPPER,
        "lark_grammar": (
            "start: analysis? final\n"
            + ANALYSIS_RULES
            + f'final: <|channel|> "final" <|message|> @{ANSWER} <|return|>\n'
        ),
    }
    return json.dumps({**top, "grammars": [wrapper, *grammars]}, ensure_ascii=False)
