"""GenerateOptions: how to generate, one frozen value for every generate method, and its keyword overrides."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypedDict

from ._chat import ToolChoice, ToolLike, to_tool


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerateOptions:
    """How to generate: sampling, stopping, what to return and the call's deadline.

    Every generate method takes one as ``options=``, and each field as a keyword that overrides it:
    ``client.generate_text(prompt, options=base, seed=1)``. Make variants with
    ``dataclasses.replace(base, temperature=0.7)``. The defaults are greedy decoding up to the server's
    default length. Values are sent as they are: the server checks them against its limits and answers
    with an InvalidRequestError that names the field.
    """

    max_new_tokens: int = 0
    """The most tokens to generate; 0 = the server's default."""
    temperature: float = 0.0
    """Softmax temperature; 0 = greedy."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 = off."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches p; 0 or 1 = off."""
    repetition_penalty: float = 1.0
    """Makes tokens already seen (the prompt's too) less likely; 0 or 1 = off."""
    presence_penalty: float = 0.0
    """OpenAI's: subtracted from the logit of every token generated so far; in [-2, 2], 0 = off."""
    frequency_penalty: float = 0.0
    """OpenAI's: subtracted from a token's logit once per time it was generated so far; in [-2, 2], 0 = off."""
    logit_bias: Mapping[int, float] = field(default_factory=dict, hash=False)
    """Token id -> number added to its logit before sampling, in [-100, 100] (-100 about bans it)."""
    seed: int | None = None
    """The same seed and request give the same tokens; None = a fresh random seed."""
    stop: Sequence[str] = ()
    """Strings that end generation (not part of the text); a single string is one stop string."""
    stop_token_ids: Sequence[int] = ()
    """Token ids that end generation as EOS does."""
    ignore_eos: bool = False
    """Keep going past end-of-sequence, up to max_new_tokens or the end of the context."""
    logprobs: bool = False
    """Return each generated token's log-probability."""
    top_logprobs: int = 0
    """Also return this many most likely alternatives at each position (implies logprobs)."""
    prompt_logprobs: bool = False
    """Return the prompt's tokens with their log-probabilities in the first event."""
    n: int = 1
    """How many choices (completions of the same prompt) to generate; their events carry ``index``.
    They share the prompt's computation; choice 0 uses ``seed`` and choice i a seed derived from
    (seed, i), so a seeded choice i is the same whatever n is. generate_choices() collects them."""
    request_id: str | None = None
    """Echoed in every event and in the server's logs; None = the server makes one."""
    adapter: str = ""
    """The LoRA adapter to generate with, by the name the server loaded it as; "" = the base model."""
    timeout: float | None = None
    """Deadline of the whole call in seconds, retries included; None = the client's default."""
    json_schema: str | Mapping[str, Any] | None = field(default=None, hash=False)
    """The output is JSON valid against this JSON Schema (a mapping, or its JSON text); at most one constraint."""
    json_object: bool = False
    """The output is one JSON object."""
    regex: str | None = None
    """The whole output matches this regular expression."""
    grammar: str | None = None
    """The output matches this grammar (in ``grammar_syntax``)."""
    grammar_syntax: Literal["lark", "gbnf"] = "lark"
    """How ``grammar`` is written: Lark (start rule ``start``) or llama.cpp's GBNF (start rule ``root``)."""
    tools: Sequence[ToolLike] = ()
    """Functions the model may call (chat input only): Tools or OpenAI-style mappings. A call ends the answer:
    the last event carries it in ``tool_calls``, with FinishReason.TOOL_CALLS."""
    tool_choice: ToolChoice = "auto"
    """"auto": the model decides; "none": no calls (the tools are not offered); "required": the answer is
    one or more calls; FunctionChoice(name): a call of that function. "required" and a function are
    enforced by a grammar, so the arguments validate against the function's schema. Not with a constraint."""
    parallel_tool_calls: bool | None = None
    """Whether one answer may hold several calls; None = the server's default (yes)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "tools", tuple(to_tool(t) for t in self.tools))
        if self.json_schema is not None and not isinstance(self.json_schema, str):
            object.__setattr__(self, "json_schema", json.dumps(self.json_schema))
        # Tuples, so that options stay immutable (and hashable) whatever sequence was given.
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        # A copy: a caller's dict changing later changes nothing (it is left out of the hash, as a dict is).
        object.__setattr__(self, "logit_bias", dict(self.logit_bias))


class GenerateOverrides(TypedDict, total=False):
    """GenerateOptions' fields as keyword arguments of the generate methods (``**overrides``).

    Names and types match GenerateOptions field for field: mypy checks the types where the overrides
    are applied (``dataclasses.replace``), and a test checks that no field is missing.
    """

    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    logit_bias: Mapping[int, float]
    seed: int | None
    stop: Sequence[str]
    stop_token_ids: Sequence[int]
    ignore_eos: bool
    logprobs: bool
    top_logprobs: int
    prompt_logprobs: bool
    n: int
    request_id: str | None
    adapter: str
    timeout: float | None
    json_schema: str | Mapping[str, Any] | None
    json_object: bool
    regex: str | None
    grammar: str | None
    grammar_syntax: Literal["lark", "gbnf"]
    tools: Sequence[ToolLike]
    tool_choice: ToolChoice
    parallel_tool_calls: bool | None


_DEFAULT_OPTIONS = GenerateOptions()
_OPTION_NAMES = frozenset(f.name for f in dataclasses.fields(GenerateOptions))


def resolve_options(caller: str, options: GenerateOptions | None, overrides: GenerateOverrides) -> GenerateOptions:
    """``options`` (default: GenerateOptions()) with the keyword ``overrides`` of ``caller`` applied.

    A keyword that is not an option is a TypeError, as it would be for a signature that listed them.
    """
    unknown = sorted(overrides.keys() - _OPTION_NAMES)
    if unknown:
        raise TypeError(f"{caller}() got an unexpected keyword argument {unknown[0]!r}")
    if options is None:
        options = _DEFAULT_OPTIONS
    elif not isinstance(options, GenerateOptions):
        raise TypeError(f"options must be a GenerateOptions, got {type(options).__name__}")
    return dataclasses.replace(options, **overrides) if overrides else options
