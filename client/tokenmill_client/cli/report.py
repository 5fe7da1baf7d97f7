"""What the CLI writes: answers on stdout; summaries, statistics and errors on stderr; and its exit codes."""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from collections.abc import Sequence
from typing import Any

from .._chat import ToolCall
from .._types import GenerateEvent, Token
from ..errors import (
    AuthenticationError,
    DeadlineExceededError,
    InvalidRequestError,
    OverloadedError,
    TokenmillError,
    UnavailableError,
)

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, as a shell reports a process killed by it


class UsageError(Exception):
    """A bad command line: reported as one line, exit code 2."""


def out(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def err(text: str) -> None:
    sys.stderr.write(text)
    sys.stderr.flush()


def error_line(message: str) -> None:
    err(f"error: {' '.join(message.split())}\n")


# gRPC's wording when no connection could be made (as opposed to a server that answered UNAVAILABLE).
_CONNECTION_FAILURES = ("failed to connect", "connection refused", "errors resolving", "dns resolution failed")


# The server names the GenerateRequest's fields; a CLI user set them with these flags.
_FLAGS = {
    "max_new_tokens": "--max-new-tokens",
    "sampling.temperature": "--temperature",
    "sampling.top_k": "--top-k",
    "sampling.top_p": "--top-p",
    "sampling.repetition_penalty": "--repetition-penalty",
    "sampling.presence_penalty": "--presence-penalty",
    "sampling.frequency_penalty": "--frequency-penalty",
    "sampling.logit_bias": "--logit-bias",
    "sampling.seed": "--seed",
    "stopping.stop": "--stop",
    "json_schema": "--json-schema",
    "regex": "--regex",
    "grammar.text": "--grammar",
}
_FIELD = re.compile(
    r"(?<![\w.])(?:stopping\.)?max_new_tokens\b|(?<![\w.])(?:sampling\.\w+|stopping\.stop)\b"
    r"|(?<![\w.])(?:json_schema|regex|grammar\.text)(?=:)"
)


def flag_names(message: str) -> str:
    """The server's message with each request field it names written as the flag that sets it."""
    return _FIELD.sub(lambda m: _FLAGS.get(m.group(), _FLAGS.get(m.group().rpartition(".")[2], m.group())), message)


def describe_error(error: TokenmillError) -> str:
    """One line for a failed call, naming the server for connection problems."""
    if isinstance(error, UnavailableError):
        if any(sign in error.message.lower() for sign in _CONNECTION_FAILURES):
            return f"cannot reach the server at {error.target}: {error.message}"
        return f"the server at {error.target} is unavailable: {error.message}"
    if isinstance(error, InvalidRequestError):
        return f"invalid request: {flag_names(error.message)}"
    if isinstance(error, OverloadedError):
        return f"server overloaded: {error.message}"
    if isinstance(error, DeadlineExceededError):
        return f"timed out: {error.message}"
    if isinstance(error, AuthenticationError):
        return f"authentication failed: {error.message}"
    code = error.code.name if error.code is not None else "ERROR"
    return f"{code}: {error.message}"


def _jsonable(value: Any) -> Any:
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) and not isinstance(value, type) else value


def json_line(value: Any) -> str:
    return json.dumps(_jsonable(value), ensure_ascii=False) + "\n"


def tool_call_json(call: ToolCall) -> dict[str, Any]:
    """A call in OpenAI's shape (what an assistant message of a later request's history carries)."""
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def tool_call_lines(calls: Sequence[ToolCall]) -> str:
    return "".join(json.dumps(tool_call_json(c), ensure_ascii=False) + "\n" for c in calls)


def _fmt_logprob(token: Token) -> str:
    return "-" if token.logprob is None else f"{token.logprob:.4f}"


def token_line(token: Token) -> str:
    return f"{token.text!r}\t{_fmt_logprob(token)}\n"


def fmt_num(value: float) -> str:
    return f"{value:g}"


def stats_line(event: GenerateEvent) -> str:
    usage, timing = event.usage, event.timing
    parts = [f"finish={event.finish_reason}"]
    if usage is not None:
        parts.append(f"prompt_tokens={usage.prompt_tokens} completion_tokens={usage.completion_tokens}")
    if timing is not None:
        parts.append(f"ttft_ms={timing.time_to_first_token_ms:.1f} total_ms={timing.total_ms:.1f}")
    return "[" + " ".join(parts) + "]\n"
