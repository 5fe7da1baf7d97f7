"""OpenAI's Responses API as JSON Schema, for /openapi.json: the body responses_protocol.py reads, its answer (whole,
and a stream's events by name); its errors are OpenAI's (openai_response_schema.ERROR).

A Responses body is read as the chat body it means, so each parameter the chat path checks takes the chat
parameter's own schema (openai_schema.parameter_schemas: the same constants and the server's limits); what is the
Responses API's alone (input items, flat function tools, text.format, the refused stateful parameters) is described
here, as the parser beside it reads it. Other top-level fields are ignored, as the parser ignores them.
"""

from __future__ import annotations

from tokenmill_service.front.http.openai_schema import (
    BOOLEAN,
    COUNT,
    INTEGER,
    JSON_SCHEMA_TEXT,
    NULL,
    OBJECT,
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
from tokenmill_service.front.http.responses_protocol import REFUSED
from tokenmill_service.front.validation import Limits

# -- the request -------------------------------------------------------------------------------------

_PART: Schema = {
    "anyOf": [
        block(["input_text", "output_text"], "text", text=STRING),
        block("refusal", "refusal", refusal=STRING),
    ]
}
_CONTENT: Schema = {"anyOf": [STRING, {"type": "array", "items": _PART}], "description": "a string or text parts"}
_MESSAGE_IN: Schema = obj(
    "role",
    "content",
    type={"const": "message", "description": "absent: a message"},
    role={"enum": ["user", "assistant", "system", "developer"]},
    content=_CONTENT,
)
_ITEM: Schema = {
    "anyOf": [
        _MESSAGE_IN,
        block("function_call", "call_id", "name", "arguments", call_id=STRING, name=STRING, arguments=STRING),
        block("function_call_output", "call_id", "output", call_id=STRING, output=_CONTENT),
        {**block("reasoning"), "description": "an earlier answer's reasoning: left out of the prompt"},
    ]
}
INPUT: Schema = {
    "anyOf": [STRING, {"type": "array", "minItems": 1, "items": _ITEM}],
    "description": "a string (the user's turn), or message, function_call and function_call_output items",
}
TOOL: Schema = block(
    "function",
    "name",
    name=TOOL_NAME_SCHEMA,
    description=nullable(STRING),
    parameters=nullable({**OBJECT, "description": "a JSON schema of the arguments"}),
)
TOOL_CHOICE: Schema = {"anyOf": [{"enum": ["auto", "none", "required"]}, block("function", "name", name=STRING), NULL]}
_FORMAT: Schema = {
    "anyOf": [
        block(["text", "json_object"]),
        block(
            "json_schema",
            "schema",
            schema=JSON_SCHEMA_TEXT,
            name=nullable(TOOL_NAME_SCHEMA),
            description=nullable(STRING),
            strict=nullable(BOOLEAN),
        ),
        NULL,
    ]
}


def _refused(neutral: object, why: str) -> Schema:
    allowed: Schema = NULL if neutral is None else {"enum": [neutral, None]}
    return {**allowed, "description": f"not supported: {why}"}


def request_schema(limits: Limits) -> Schema:
    """A /v1/responses body."""
    chat = parameter_schemas(limits, chat=True)
    described: dict[str, Schema] = {
        "model": chat["model"],
        "input": INPUT,
        "instructions": nullable({**STRING, "description": "the system message"}),
        "max_output_tokens": nullable(
            between("integer", 1, limits.max_new_tokens, description="prompt + max_output_tokens must fit the context")
        ),
        "tools": nullable({"type": "array", "items": TOOL}),
        "tool_choice": TOOL_CHOICE,
        "text": nullable(obj(format=_FORMAT)),
        "metadata": nullable({**OBJECT, "description": "repeated in the answer"}),
        **{name: chat[name] for name in ("temperature", "top_p", "stream", "parallel_tool_calls")},
        **{name: _refused(neutral, why) for name, (neutral, why) in REFUSED.items()},
    }
    return {
        "type": "object",
        "description": "other fields (store, include, reasoning, truncation, user, ...) are accepted and ignored",
        "required": ["input"],
        "properties": dict(sorted(described.items())),
    }


# -- the answer --------------------------------------------------------------------------------------

_OUTPUT_TEXT = block(
    "output_text",
    "text",
    "annotations",
    "logprobs",
    text=STRING,
    annotations={"type": "array", "maxItems": 0},
    logprobs={"type": "array", "maxItems": 0},
)


def _message(status: Schema, parts: int | None = None) -> Schema:
    content: Schema = {"type": "array", "items": _OUTPUT_TEXT}
    if parts is not None:
        content |= {"minItems": parts, "maxItems": parts}
    return block(
        "message",
        "id",
        "status",
        "role",
        "content",
        id=STRING,
        status=status,
        role={"const": "assistant"},
        content=content,
    )


def _call(status: Schema) -> Schema:
    fields = ("id", "call_id", "name", "arguments", "status")
    return block("function_call", *fields, **{**dict.fromkeys(fields[:-1], STRING), "status": status})


DONE: Schema = {"enum": ["completed", "incomplete"]}
ITEM: Schema = {"anyOf": [_message(DONE, 1), _call({"const": "completed"})]}
_ADDED: Schema = {"anyOf": [_message({"const": "in_progress"}, 0), _call({"const": "in_progress"})]}
USAGE: Schema = obj(
    "input_tokens",
    "input_tokens_details",
    "output_tokens",
    "output_tokens_details",
    "total_tokens",
    input_tokens=COUNT,
    input_tokens_details=obj("cached_tokens", cached_tokens=COUNT),
    output_tokens=COUNT,
    output_tokens_details=obj("reasoning_tokens", reasoning_tokens=COUNT),
    total_tokens=COUNT,
)
# What a response repeats of its request (responses_protocol._echoed), defaults filled in.
_ECHOED: dict[str, Schema] = {
    "instructions": nullable(STRING),
    "max_output_tokens": nullable(INTEGER),
    "temperature": {"type": "number"},
    "top_p": {"type": "number"},
    "tools": {"type": "array", "items": OBJECT},
    "tool_choice": {"anyOf": [STRING, OBJECT]},
    "parallel_tool_calls": BOOLEAN,
    "text": obj("format", format=OBJECT),
    "metadata": OBJECT,
}


def _response(status: Schema, output: Schema, usage: Schema) -> Schema:
    properties: dict[str, Schema] = {
        "id": STRING,
        "object": {"const": "response"},
        "created_at": INTEGER,
        "status": status,
        "error": NULL,
        "incomplete_details": {
            "anyOf": [
                obj("reason", reason={"const": "max_output_tokens"}),
                NULL,
            ],
            "description": "with status incomplete",
        },
        "model": STRING,
        "output": output,
        "previous_response_id": NULL,
        "store": {"const": False, "description": "nothing is stored"},
        "truncation": {"const": "disabled"},
        **_ECHOED,
        "usage": usage,
    }
    return {"type": "object", "required": list(properties), "properties": properties}


_OUTPUT: Schema = {"type": "array", "items": ITEM}
RESPONSE = _response(DONE, _OUTPUT, USAGE)
_STARTED = _response({"const": "in_progress"}, {"type": "array", "maxItems": 0}, NULL)


def _event(kind: str, *required: str, **properties: Schema) -> Schema:
    return block(kind, "sequence_number", *required, sequence_number=COUNT, **properties)


_WHERE = {"item_id": STRING, "output_index": COUNT}
_PART_WHERE = {**_WHERE, "content_index": {"const": 0}}
_EMPTY_PART = block(
    "output_text", "text", text={"const": ""}, annotations={"type": "array"}, logprobs={"type": "array"}
)
# A stream's events, by name (each event's `type`, numbered by sequence_number from 0); a failure after the status
# was sent is the error event, OpenAI's error fields beside its type.
EVENTS = by_type(
    _event("response.created", "response", response=_STARTED),
    _event("response.in_progress", "response", response=_STARTED),
    _event("response.output_item.added", "output_index", "item", output_index=COUNT, item=_ADDED),
    _event("response.content_part.added", *_PART_WHERE, "part", **_PART_WHERE, part=_EMPTY_PART),
    _event(
        "response.output_text.delta", *_PART_WHERE, "delta", **_PART_WHERE, delta=STRING, logprobs={"type": "array"}
    ),
    _event("response.output_text.done", *_PART_WHERE, "text", **_PART_WHERE, text=STRING, logprobs={"type": "array"}),
    _event("response.content_part.done", *_PART_WHERE, "part", **_PART_WHERE, part=_OUTPUT_TEXT),
    _event("response.output_item.done", "output_index", "item", output_index=COUNT, item=ITEM),
    _event(
        "response.function_call_arguments.delta",
        *_WHERE,
        "delta",
        **_WHERE,
        delta={**STRING, "description": "all of them"},
    ),
    _event(
        "response.function_call_arguments.done", *_WHERE, "name", "arguments", **_WHERE, name=STRING, arguments=STRING
    ),
    _event(
        "response.completed",
        "response",
        response=_response({"const": "completed"}, _OUTPUT, USAGE),
    ),
    _event(
        "response.incomplete",
        "response",
        response=_response({"const": "incomplete"}, _OUTPUT, USAGE),
    ),
    _event(
        "error",
        "code",
        "message",
        "param",
        code=nullable(STRING),
        message=STRING,
        param={**nullable(STRING), "description": "the parameter at fault, as the request named it"},
    ),
)
