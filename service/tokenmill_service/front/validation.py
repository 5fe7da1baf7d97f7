"""Turning a GenerateRequest into an engine request, or a precise INVALID_ARGUMENT message.

Every message names the field and the limit, so a caller can fix the request without
reading the server's code.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from tokenmill_service.contract.chat.harmony_constraint import names_control_tokens
from tokenmill_service.contract.chat.harmony_response_format import DEFAULT_NAME, ResponseFormat
from tokenmill_service.contract.chat.tool_calls import TOOL_NAME, Tool
from tokenmill_service.contract.request import (
    MIN_TEMPERATURE,
    Constraint,
    GenerationRequest,
    SamplingParams,
    StoppingParams,
)
from tokenmill_service.contract.tokenizer import Tokenizer
from tokenmill_service.front.proto import pb
from tokenmill_service.front.tool_validation import (
    ToolError,
    chat_with_tools,
    parse_tools,
    tool_constraint,
    tools_in_use,
)

if TYPE_CHECKING:
    from tokenmill_service.contract.config import Settings

# Fixed limits (the configurable ones are in Limits); all are reported by GetModelInfo.
# A request id is echoed in every response and log line: bounded, and printable.
MAX_REQUEST_ID_LENGTH = 128
# Matching a stop string costs its length per generated token: bounded.
MAX_STOP_STRING_LENGTH = 256
MAX_STOP_TOKEN_IDS = 256
# Biasing a token costs a logit write per step: bounded (OpenAI allows as many).
MAX_LOGIT_BIAS = 1024
# Each choice of a request (GenerateRequest.n) is a sequence of its own in the engine's batch: bounded.
MAX_CHOICES = 16
# OpenAI's ranges for its penalties and biases.
MAX_PENALTY = 2.0
MAX_LOGIT_BIAS_VALUE = 100.0


class InvalidRequest(ValueError):
    """A request field the server refuses. ``field`` is its path in the GenerateRequest (as the message
    names it), so a front-end can name it the way its caller does; ``code`` is the kind of problem, in
    OpenAI's words (what the HTTP API reports as the error's code)."""

    def __init__(self, message: str, field: str | None = None, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.field = field
        self.code = code


def check_request_id(request_id: str, source: str = "request_id") -> str:
    if len(request_id) > MAX_REQUEST_ID_LENGTH:
        raise InvalidRequest(
            f"{source} has {len(request_id)} characters; at most {MAX_REQUEST_ID_LENGTH} are allowed", source
        )
    if not request_id.isprintable():
        raise InvalidRequest(f"{source} holds a control character; use printable characters only", source)
    return request_id


@dataclass(slots=True, frozen=True)
class Limits:
    context_length: int
    vocab_size: int
    max_new_tokens: int
    max_top_logprobs: int
    max_stop_strings: int
    # Used when a request sets no max_new_tokens, so a greedy loop cannot run to the end of the context.
    default_max_new_tokens: int = 0
    # JSON schemas (and tools' arguments) read as JSON Schema reads them (--json-schema-permissive).
    json_schema_permissive: bool = False

    @classmethod
    def from_settings(cls, settings: Settings, context_length: int = 0, vocab_size: int = 0) -> Limits:
        """The flags' limits with the model's bounds (0: not known yet, as while the model loads)."""
        return settings.subset(
            cls, context_length=context_length, vocab_size=vocab_size, max_new_tokens=settings.max_new_tokens_limit
        )


# Where each kind of prompt is, as a field path.
_INPUT_FIELDS = {"prompt": "prompt", "chat": "chat.messages", "token_ids": "token_ids.ids"}


def chat_messages(
    chat: pb.Messages, tokenizer: Tokenizer, tools: Sequence[Tool] = ()
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages for the chat template, and the tools to pass it (None: none, or offered in a message)."""
    if not chat.messages:
        raise InvalidRequest("chat.messages is empty: give at least one message", "chat.messages")
    messages, template_tools = chat_with_tools(chat, tools, tokenizer)
    try:
        tokenizer.validate_messages(messages)
    except ValueError as exc:
        raise InvalidRequest(f"chat.messages: {exc}", "chat.messages") from None
    return messages, template_tools


def offered_tools(request: pb.GenerateRequest | pb.TokenizeRequest) -> list[Tool]:
    """The tools the prompt offers (none with TOOL_CHOICE_NONE)."""
    if not isinstance(request, pb.GenerateRequest) or not tools_in_use(request):
        return []
    try:
        return parse_tools(request)
    except ToolError as exc:
        raise InvalidRequest(str(exc), exc.field) from None


def prompt_ids(request: pb.GenerateRequest | pb.TokenizeRequest, tokenizer: Tokenizer, vocab_size: int) -> list[int]:
    which = request.WhichOneof("input")
    if which is None:
        field_names = "prompt, chat or token_ids" if isinstance(request, pb.GenerateRequest) else "text or chat"
        raise InvalidRequest(f"input is missing: set one of {field_names}", "input")
    if which in ("prompt", "text"):
        text: str = getattr(request, which)
        if not text:
            raise InvalidRequest(f"{which} is empty", which)
        ids = tokenizer.encode(text)
        if tokenizer.add_bos and tokenizer.bos_token_id is not None:
            ids = [tokenizer.bos_token_id, *ids]
        return ids
    if which == "chat":
        described = described_format(request) if tokenizer.harmony else None
        try:
            messages, template_tools = chat_messages(request.chat, tokenizer, offered_tools(request))
            return tokenizer.encode_chat(messages, tools=template_tools, response_format=described)
        except InvalidRequest:
            raise
        except ValueError as exc:
            raise InvalidRequest(f"chat: {exc}", "chat.messages") from None
    ids = list(request.token_ids.ids)  # type: ignore[union-attr]
    if not ids:
        raise InvalidRequest("token_ids.ids is empty", "token_ids.ids")
    check_token_ids("token_ids.ids", ids, vocab_size)
    return ids


def described_format(request: pb.GenerateRequest | pb.TokenizeRequest) -> ResponseFormat | None:
    """The JSON schema the answer must match, as a harmony prompt describes it (None: no json_schema)."""
    if not isinstance(request, pb.GenerateRequest) or request.WhichOneof("constraint") != "json_schema":
        return None
    if not request.json_schema.strip():
        return None  # refused as empty (constraint)
    try:
        schema = json.loads(request.json_schema)
    except ValueError as exc:
        raise InvalidRequest(f"json_schema is not valid JSON: {exc}", "json_schema") from None
    except RecursionError:
        raise InvalidRequest("json_schema is nested too deeply", "json_schema") from None
    return ResponseFormat(schema, format_name(request), request.json_schema_description)


def format_name(request: pb.GenerateRequest) -> str:
    """json_schema_name, checked (it is a line of a harmony prompt), or the default."""
    name = request.json_schema_name
    if name and not TOOL_NAME.fullmatch(name):
        raise InvalidRequest(
            f"json_schema_name must be 1 to 64 letters, digits, '_' or '-'; given {name!r}", "json_schema_name"
        )
    return name or DEFAULT_NAME


def check_token_ids(field_name: str, ids: Sequence[int], vocab_size: int) -> None:
    for i, t in enumerate(ids):
        if t >= vocab_size:
            raise InvalidRequest(
                f"{field_name}[{i}] = {t} is outside the vocabulary (ids are 0..{vocab_size - 1})", field_name
            )


def sampling_params(s: pb.SamplingParams, vocab_size: int) -> SamplingParams:
    if not math.isfinite(s.temperature) or s.temperature < 0:
        raise InvalidRequest(
            f"sampling.temperature must be >= 0 (0 = greedy); given {s.temperature}", "sampling.temperature"
        )
    if s.top_k < 0:
        raise InvalidRequest(f"sampling.top_k must be >= 0 (0 = off); given {s.top_k}", "sampling.top_k")
    if not math.isfinite(s.top_p) or not 0.0 <= s.top_p <= 1.0:
        raise InvalidRequest(f"sampling.top_p must be in [0, 1] (0 or 1 = off); given {s.top_p}", "sampling.top_p")
    if not math.isfinite(s.repetition_penalty) or s.repetition_penalty < 0:
        raise InvalidRequest(
            f"sampling.repetition_penalty must be >= 0 (0 or 1 = off); given {s.repetition_penalty}",
            "sampling.repetition_penalty",
        )
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(s, name)
        if not math.isfinite(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
            raise InvalidRequest(
                f"sampling.{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}] (0 = off); given {value}",
                f"sampling.{name}",
            )
    if len(s.logit_bias) > MAX_LOGIT_BIAS:
        raise InvalidRequest(
            f"sampling.logit_bias holds {len(s.logit_bias)} tokens; at most {MAX_LOGIT_BIAS} are allowed",
            "sampling.logit_bias",
        )
    for token, bias in s.logit_bias.items():
        if token >= vocab_size:
            raise InvalidRequest(
                f"sampling.logit_bias names token {token}, outside the vocabulary (ids are 0..{vocab_size - 1})",
                "sampling.logit_bias",
            )
        if not math.isfinite(bias) or not -MAX_LOGIT_BIAS_VALUE <= bias <= MAX_LOGIT_BIAS_VALUE:
            raise InvalidRequest(
                f"sampling.logit_bias[{token}] must be in [-{MAX_LOGIT_BIAS_VALUE:g}, {MAX_LOGIT_BIAS_VALUE:g}]; "
                f"given {bias}",
                "sampling.logit_bias",
            )
    return SamplingParams(
        # Too small to divide by: greedy, which is what such a temperature means anyway.
        temperature=s.temperature if s.temperature >= MIN_TEMPERATURE else 0.0,
        top_k=s.top_k,
        top_p=s.top_p if 0.0 < s.top_p < 1.0 else 1.0,
        repetition_penalty=s.repetition_penalty if s.repetition_penalty not in (0.0, 1.0) else 1.0,
        seed=s.seed if s.HasField("seed") else None,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        logit_bias={int(t): float(b) for t, b in s.logit_bias.items() if b != 0.0},
    )


def stopping_params(s: pb.StoppingParams, limits: Limits) -> StoppingParams:
    if s.max_new_tokens > limits.max_new_tokens:
        raise InvalidRequest(
            f"stopping.max_new_tokens must be <= {limits.max_new_tokens} (the server's limit); given {s.max_new_tokens}",
            "stopping.max_new_tokens",
            "integer_above_max_value",
        )
    if len(s.stop) > limits.max_stop_strings:
        raise InvalidRequest(
            f"stopping.stop holds {len(s.stop)} strings; at most {limits.max_stop_strings} are allowed", "stopping.stop"
        )
    for i, stop in enumerate(s.stop):
        if not stop:
            raise InvalidRequest(f"stopping.stop[{i}] is empty", "stopping.stop")
        if len(stop) > MAX_STOP_STRING_LENGTH:
            raise InvalidRequest(
                f"stopping.stop[{i}] has {len(stop)} characters; at most {MAX_STOP_STRING_LENGTH} are allowed",
                "stopping.stop",
            )
    if len(s.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequest(
            f"stopping.stop_token_ids holds {len(s.stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS} are allowed",
            "stopping.stop_token_ids",
        )
    check_token_ids("stopping.stop_token_ids", s.stop_token_ids, limits.vocab_size)
    return StoppingParams(
        max_new_tokens=s.max_new_tokens or limits.default_max_new_tokens,
        stop=list(s.stop),
        stop_token_ids=list(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
    )


# The grammar notations GrammarSyntax names, as the grammar engine calls them.
_GRAMMAR_SYNTAXES = {
    pb.GRAMMAR_SYNTAX_UNSPECIFIED: "lark",
    pb.GRAMMAR_SYNTAX_LARK: "lark",
    pb.GRAMMAR_SYNTAX_GBNF: "gbnf",
}
# Where each kind of constraint is, as a field path.
CONSTRAINT_FIELDS = {
    "json_schema": "json_schema",
    "json_object": "json_object",
    "regex": "regex",
    "grammar": "grammar.text",
}


def constraint(request: pb.GenerateRequest, permissive: bool = False) -> Constraint | None:
    """The request's constraint, its form checked (whether it compiles is the grammar compiler's to say).
    ``permissive``: a JSON schema read as JSON Schema reads it (contract/closed_schema.py)."""
    which = request.WhichOneof("constraint")
    if which is None:
        return None
    if which == "json_object":
        return Constraint("json_object")
    if which == "grammar":
        syntax = _GRAMMAR_SYNTAXES.get(request.grammar.syntax)
        if syntax is None:
            raise InvalidRequest(f"grammar.syntax {request.grammar.syntax} is not a GrammarSyntax", "grammar.syntax")
        text = request.grammar.text
    else:
        syntax, text = "", getattr(request, which)
        if which == "json_schema":
            format_name(request)
    if not text.strip():
        raise InvalidRequest(f"{CONSTRAINT_FIELDS[which]} is empty", CONSTRAINT_FIELDS[which])
    return Constraint(which, text, syntax, permissive=permissive and which == "json_schema")


def build_request(request: pb.GenerateRequest, tokenizer: Tokenizer, limits: Limits) -> GenerationRequest:
    check_request_id(request.request_id)
    sampling = sampling_params(request.sampling, limits.vocab_size)
    stopping = stopping_params(request.stopping, limits)
    if request.top_logprobs > limits.max_top_logprobs:
        raise InvalidRequest(
            f"top_logprobs must be <= {limits.max_top_logprobs} (the server's limit); given {request.top_logprobs}",
            "top_logprobs",
            "integer_above_max_value",
        )
    if request.n > MAX_CHOICES:
        raise InvalidRequest(
            f"n must be <= {MAX_CHOICES} (choices of one request); given {request.n}", "n", "integer_above_max_value"
        )
    ids = prompt_ids(request, tokenizer, limits.vocab_size)
    ctx = limits.context_length
    if len(ids) >= ctx:
        raise InvalidRequest(
            f"the prompt has {len(ids)} tokens but the context holds {ctx}: no room to generate; shorten the prompt",
            _INPUT_FIELDS[request.WhichOneof("input") or "prompt"],
            "context_length_exceeded",
        )
    room = ctx - len(ids)
    if request.stopping.max_new_tokens and stopping.max_new_tokens > room:
        raise InvalidRequest(
            f"prompt tokens + stopping.max_new_tokens must be <= {ctx} (the context length); "
            f"given {len(ids)} prompt tokens and max_new_tokens {stopping.max_new_tokens}",
            "stopping.max_new_tokens",
            "context_length_exceeded",
        )
    if stopping.max_new_tokens > room:
        # The server's default, not the caller's ask: the request gets the room that is left, as OpenAI's
        # and vLLM's servers do, and ends with CONTEXT_LIMIT (0 = until the end of the context).
        stopping.max_new_tokens = 0
    return GenerationRequest(
        request_id=request.request_id,
        prompt_ids=ids,
        sampling=sampling,
        stopping=stopping,
        logprobs=request.logprobs or request.top_logprobs > 0,
        top_logprobs=request.top_logprobs,
        prompt_logprobs=request.prompt_logprobs,
        constraint=_constraint_or_tool_call(request, tokenizer, limits.json_schema_permissive),
        adapter=request.adapter,
    )


def _constraint_or_tool_call(
    request: pb.GenerateRequest, tokenizer: Tokenizer, permissive: bool = False
) -> Constraint | None:
    """The request's own constraint, or the grammar its tool_choice asks for (not both)."""
    own = constraint(request, permissive)
    tools = offered_tools(request)
    forced = tool_constraint(request, tools, tokenizer, permissive) if tools else None
    if own is not None and forced is not None:
        raise InvalidRequest(
            f"{CONSTRAINT_FIELDS[own.kind]} cannot be combined with a tool_choice that forces a call", "tool_choice"
        )
    harmony_chat = tokenizer.harmony and request.WhichOneof("input") == "chat"
    if own is not None and harmony_chat and not (own.kind == "grammar" and names_control_tokens(own.text)):
        # A harmony answer has headers: the constraint holds its final channel's text, unless a grammar
        # writes the headers itself (harmony_constraint.py).
        own = replace(own, harmony=True)
    return own or forced
