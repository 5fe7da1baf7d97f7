"""Anthropic's Messages API as JSON Schema, for /openapi.json: the bodies anthropic_protocol.py reads, its answers
(whole, and a stream's events by name) and its error shape.

A Messages body is read as the chat body it means, so each parameter the chat path checks takes the chat
parameter's own schema (openai_schema.parameter_schemas: the same constants and the server's limits); what is
Anthropic's alone (turns of content blocks, tools with input_schema, tool_choice, output_config) is described here,
as the parser beside it reads it. Other top-level fields are ignored, as the parser ignores them.
"""

from __future__ import annotations

from tokenmill_service.contract.grammar import MAX_CONSTRAINT_LENGTH
from tokenmill_service.front.http.anthropic_protocol import ERROR_TYPES, OTHER_ERROR, STOP_REASONS
from tokenmill_service.front.http.openai_schema import (
    BOOLEAN,
    COUNT,
    NULL,
    OBJECT,
    STOP_STRING,
    STRING,
    TOOL_NAME_SCHEMA,
    Schema,
    between,
    block,
    by_type,
    nullable,
    obj,
    parameter_schemas,
)
from tokenmill_service.front.validation import Limits

# -- the request -------------------------------------------------------------------------------------

TEXT_BLOCK = block("text", "text", text=STRING)
TEXT_BLOCKS: Schema = {
    "anyOf": [STRING, {"type": "array", "items": TEXT_BLOCK}],
    "description": "a string or text blocks",
}
TOOL_USE = block("tool_use", "id", "name", id=STRING, name=STRING, input={**OBJECT, "description": "absent: {}"})
TOOL_RESULT = block(
    "tool_result", "tool_use_id", tool_use_id=STRING, content={**TEXT_BLOCKS, "description": "absent: empty"}
)
THINKING: Schema = {
    **block(["thinking", "redacted_thinking"]),
    "description": "an earlier answer's reasoning: left out of the prompt",
}


def _turn(role: str, *blocks: Schema) -> Schema:
    content: Schema = {"anyOf": [STRING, {"type": "array", "items": {"anyOf": list(blocks)}}]}
    return obj("role", "content", role={"const": role}, content=content)


MESSAGES: Schema = {
    "type": "array",
    "minItems": 1,
    "items": {"anyOf": [_turn("user", TEXT_BLOCK, TOOL_RESULT), _turn("assistant", TEXT_BLOCK, TOOL_USE, THINKING)]},
}
TOOL: Schema = obj(
    "name",
    "input_schema",
    type={"enum": ["custom", None], "description": "client tools only: Anthropic's server tools are refused"},
    name=TOOL_NAME_SCHEMA,
    description=STRING,
    input_schema={**OBJECT, "description": "a JSON schema of the input"},
)
_PARALLEL = {"disable_parallel_tool_use": nullable(BOOLEAN)}
TOOL_CHOICE: Schema = {
    "anyOf": [
        block(["auto", "any", "none"], **_PARALLEL),
        block("tool", "name", name=STRING, **_PARALLEL),
        NULL,
    ]
}
_JSON_SCHEMA: Schema = {
    "type": "object",
    "description": f"a JSON schema, at most {MAX_CONSTRAINT_LENGTH} characters as JSON; refused (400) when it cannot "
    "be enforced or admits no finite value",
}
OUTPUT_CONFIG: Schema = nullable(obj(format=nullable(block("json_schema", "schema", schema=_JSON_SCHEMA))))


def request_schema(limits: Limits, count_only: bool = False) -> Schema:
    """A /v1/messages body, or a /v1/messages/count_tokens one (``count_only``: only what makes the prompt)."""
    chat = parameter_schemas(limits, chat=True)
    described: dict[str, Schema] = {
        "model": chat["model"],
        "messages": MESSAGES,
        "system": {"anyOf": [*TEXT_BLOCKS["anyOf"], NULL], "description": "a string or text blocks"},
        "tools": nullable({"type": "array", "items": TOOL}),
        "tool_choice": TOOL_CHOICE,
        "output_config": OUTPUT_CONFIG,
    }
    if not count_only:
        most = limits.max_new_tokens
        described |= {
            "max_tokens": between("integer", 1, most, description="prompt + max_tokens must fit the context"),
            "stop_sequences": nullable({"type": "array", "maxItems": limits.max_stop_strings, "items": STOP_STRING}),
            **{name: chat[name] for name in ("temperature", "top_p", "top_k", "stream")},
        }
    return {
        "type": "object",
        "description": "other fields (thinking, metadata, service_tier, ...) are accepted and ignored",
        "required": ["messages"] if count_only else ["max_tokens", "messages"],
        "properties": dict(sorted(described.items())),
    }


# -- the answers -------------------------------------------------------------------------------------

USAGE: Schema = obj("input_tokens", "output_tokens", input_tokens=COUNT, output_tokens=COUNT)
STOP_REASON: Schema = {"enum": sorted(set(STOP_REASONS.values()))}
STOP_SEQUENCE: Schema = {**nullable(STRING), "description": "the stop sequence matched (stop_reason stop_sequence)"}


def _message(stop_reason: Schema, content: Schema) -> Schema:
    return obj(
        "id",
        "type",
        "role",
        "model",
        "content",
        "stop_reason",
        "stop_sequence",
        "usage",
        id=STRING,
        type={"const": "message"},
        role={"const": "assistant"},
        model=STRING,
        content=content,
        stop_reason=stop_reason,
        stop_sequence=STOP_SEQUENCE,
        usage=USAGE,
    )


TOOL_USE_OUT = block("tool_use", "id", "name", "input", id=STRING, name=STRING, input=OBJECT)
MESSAGE = _message(STOP_REASON, {"type": "array", "items": {"anyOf": [TEXT_BLOCK, TOOL_USE_OUT]}})
COUNT_TOKENS: Schema = obj("input_tokens", input_tokens=COUNT)


def error(status: int | None = None) -> Schema:
    """Anthropic's error body: of the type ``status`` gives, or any (None)."""
    kinds = sorted({*ERROR_TYPES.values(), OTHER_ERROR})
    return obj(
        "type",
        "error",
        type={"const": "error"},
        error=obj(
            "type",
            "message",
            type={"enum": kinds} if status is None else {"const": ERROR_TYPES[status]},
            message=STRING,
        ),
    )


# A stream's events, by name (each event's `type`); a failure after the status was sent is the error event.
EVENTS = by_type(
    block("message_start", "message", message=_message(NULL, {"type": "array", "maxItems": 0})),
    block(
        "content_block_start",
        "index",
        "content_block",
        index=COUNT,
        content_block={
            "anyOf": [
                block("text", "text", text={"const": ""}),
                block("tool_use", "id", "name", "input", id=STRING, name=STRING, input={**OBJECT, "maxProperties": 0}),
            ]
        },
    ),
    block(
        "content_block_delta",
        "index",
        "delta",
        index=COUNT,
        delta={
            "anyOf": [
                block("text_delta", "text", text=STRING),
                block("input_json_delta", "partial_json", partial_json={**STRING, "description": "the whole input"}),
            ]
        },
    ),
    block("content_block_stop", "index", index=COUNT),
    block(
        "message_delta",
        "delta",
        "usage",
        delta=obj("stop_reason", "stop_sequence", stop_reason=STOP_REASON, stop_sequence=STOP_SEQUENCE),
        usage=USAGE,
    ),
    block("message_stop"),
    error(),
)
