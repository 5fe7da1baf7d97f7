"""The HTTP API's request bodies as JSON Schema (2020-12, what OpenAPI 3.1 uses), for /openapi.json (its answers
are in openai_response_schema.py).

Each request schema describes what the parser beside it (openai_protocol.py) reads, with the bounds that it and
validation.py enforce, taken from the same constants and the server's own limits (``Limits``: its vocabulary,
--max-new-tokens-limit, --max-top-logprobs, --max-stop-strings). A chat or completions body's properties are
exactly ``parameters(chat)``, the fields the parser accepts: describing a new parameter is one entry in
``parameter_schemas``, and a unit test checks that the parser reads every field described and nothing else.
"""

from __future__ import annotations

from typing import Any

from tokenmill_service.contract.chat.tool_calls import TOOL_NAME
from tokenmill_service.contract.grammar import MAX_CONSTRAINT_LENGTH
from tokenmill_service.front.http.openai_protocol import IGNORED, MAX_PROMPTS, NEUTRAL_ONLY, TOKEN_ID_KEY, parameters
from tokenmill_service.front.http.request_fields import UINT32_MAX
from tokenmill_service.front.validation import (
    MAX_CHOICES,
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_VALUE,
    MAX_PENALTY,
    MAX_STOP_STRING_LENGTH,
    MAX_STOP_TOKEN_IDS,
    Limits,
)

Schema = dict[str, Any]

NULL: Schema = {"type": "null"}
STRING: Schema = {"type": "string"}
INTEGER: Schema = {"type": "integer"}
BOOLEAN: Schema = {"type": "boolean"}
OBJECT: Schema = {"type": "object"}
COUNT: Schema = {"type": "integer", "minimum": 0}


def nullable(schema: Schema) -> Schema:
    """``schema`` or JSON's null (which every parameter takes, as absent)."""
    if isinstance(schema.get("type"), str) and "enum" not in schema and "const" not in schema:
        return {**schema, "type": [schema["type"], "null"]}
    return {"anyOf": [schema, NULL]}


def obj(*required: str, **properties: Schema) -> Schema:
    """An object with ``properties``, the ``required`` ones required."""
    schema: Schema = {"type": "object"}
    if required:
        schema["required"] = list(required)
    schema["properties"] = properties
    return schema


def between(kind: str, minimum: float | None = None, maximum: float | None = None, **rest: Any) -> Schema:
    schema: Schema = {"type": kind, **rest}
    if minimum is not None:
        schema["minimum"] = minimum
    if maximum is not None:
        schema["maximum"] = maximum
    return schema


def block(kind: str | list[str], *required: str, **properties: Schema) -> Schema:
    """An object whose ``type`` is ``kind`` (or one of several; Anthropic's content blocks, the Responses API's items
    and every event of theirs), with ``properties``, ``type`` and the ``required`` ones required."""
    return {
        "type": "object",
        "required": ["type", *required],
        "properties": {"type": {"const": kind} if isinstance(kind, str) else {"enum": kind}, **properties},
    }


def by_type(*blocks: Schema) -> dict[str, Schema]:
    """Blocks (a stream's events) by their ``type``."""
    return {schema["properties"]["type"]["const"]: schema for schema in blocks}


def pattern(regex: Any) -> str:
    """A Python ``fullmatch`` regex as a JSON Schema pattern (which searches)."""
    return f"^(?:{regex.pattern})$"


def token_id(limits: Limits) -> Schema:
    top = limits.vocab_size - 1 if limits.vocab_size else UINT32_MAX
    return between("integer", 0, top, description="a token id, below the model's vocabulary size")


# -- chat messages and tools ------------------------------------------------------------------------

TEXT_PART: Schema = obj("type", "text", type={"const": "text"}, text=STRING)
TOOL_CALL_IN: Schema = obj(
    "function",
    id={"description": "the call's id, as text"},
    function=obj("name", name=STRING, arguments={"description": "a JSON object, as text or as JSON"}),
)
MESSAGE: Schema = obj(
    "role",
    role={"type": "string", "description": "system, user, assistant or tool (the chat template decides)"},
    content={"anyOf": [STRING, {"type": "array", "items": TEXT_PART}, NULL]},
    name=nullable(STRING),
    tool_call_id=nullable(STRING),
    tool_calls=nullable({"type": "array", "items": TOOL_CALL_IN}),
    reasoning_content=nullable(STRING),
    reasoning=nullable(STRING),
)
MESSAGES: Schema = {"type": "array", "minItems": 1, "items": MESSAGE}
TOOL_NAME_SCHEMA: Schema = {"type": "string", "pattern": pattern(TOOL_NAME)}
TOOL: Schema = obj(
    "type",
    "function",
    type={"const": "function"},
    function=obj(
        "name",
        name=TOOL_NAME_SCHEMA,
        description=nullable(STRING),
        parameters=nullable({"type": "object", "description": "a JSON schema of the arguments"}),
    ),
)
TOOL_CHOICE: Schema = {
    "anyOf": [
        {"enum": ["none", "auto", "required"]},
        obj("function", function=obj("name", name=STRING)),
        NULL,
    ]
}

# -- output constraints (openai_constraint.py) -------------------------------------------------------

JSON_SCHEMA_TEXT: Schema = {
    "type": ["object", "boolean", "string"],
    "description": f"a JSON schema (as JSON or as text), at most {MAX_CONSTRAINT_LENGTH} characters; refused (400) "
    "when it cannot be enforced or admits no finite value",
}
CONSTRAINT_TEXT: Schema = {"type": "string", "maxLength": MAX_CONSTRAINT_LENGTH}
CHOICES: Schema = {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}}
RESPONSE_FORMAT: Schema = {
    "anyOf": [
        obj("type", type={"enum": ["text", "json_object"]}),
        obj(
            "type",
            "json_schema",
            type={"const": "json_schema"},
            json_schema=obj(
                name=nullable(TOOL_NAME_SCHEMA),
                description=nullable(STRING),
                schema=JSON_SCHEMA_TEXT,
                strict=nullable(BOOLEAN),
            ),
        ),
        NULL,
    ]
}
STRUCTURED_OUTPUTS: Schema = {
    "type": ["object", "null"],
    "description": "vLLM's: one of its keys",
    "properties": {"json": JSON_SCHEMA_TEXT, "regex": CONSTRAINT_TEXT, "grammar": CONSTRAINT_TEXT, "choice": CHOICES},
    "additionalProperties": False,
}


# -- chat and completions bodies ---------------------------------------------------------------------


def _prompt(limits: Limits) -> Schema:
    ids: Schema = {"type": "array", "minItems": 1, "items": token_id(limits)}
    text: Schema = {"type": "string", "minLength": 1}
    return {
        "description": f"a string, token ids, or a list of up to {MAX_PROMPTS} of either (one choice each)",
        "anyOf": [
            text,
            ids,
            {"type": "array", "minItems": 1, "maxItems": MAX_PROMPTS, "items": {"anyOf": [text, ids]}},
        ],
    }


STOP_STRING: Schema = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_STRING_LENGTH}


def _stop(limits: Limits) -> Schema:
    return {"anyOf": [STOP_STRING, {"type": "array", "maxItems": limits.max_stop_strings, "items": STOP_STRING}, NULL]}


def parameter_schemas(limits: Limits, chat: bool) -> dict[str, Schema]:
    """Every parameter of a chat (or completions) body, described."""
    most_tokens = limits.max_new_tokens
    penalty = {"minimum": -MAX_PENALTY, "maximum": MAX_PENALTY}
    described: dict[str, Schema] = {
        "model": nullable(
            {"type": "string", "description": "any name: the server has one model (or a LoRA adapter's)"}
        ),
        "n": nullable(between("integer", 1, MAX_CHOICES, description="choices of each prompt")),
        "temperature": nullable(between("number", 0, description="0 = greedy; absent = 1")),
        "top_p": nullable(between("number", 0, 1)),
        "top_k": nullable(between("integer", 0, 2**31 - 1, description="0 = off")),
        "repetition_penalty": nullable(between("number", 0, description="0 or 1 = off")),
        "seed": nullable(between("integer", 0, 2**64 - 1)),
        "presence_penalty": nullable(between("number", **penalty)),
        "frequency_penalty": nullable(between("number", **penalty)),
        "logit_bias": nullable(
            {
                "type": "object",
                "description": "token id (below the vocabulary size) -> bias",
                "maxProperties": MAX_LOGIT_BIAS,
                "propertyNames": {"pattern": pattern(TOKEN_ID_KEY)},
                "additionalProperties": between("number", -MAX_LOGIT_BIAS_VALUE, MAX_LOGIT_BIAS_VALUE),
            }
        ),
        "max_tokens": nullable(
            between(
                "integer",
                1 if chat else 0,
                most_tokens,
                description="absent = the server's default, or the room the prompt leaves; prompt + max_tokens must "
                "fit the context" + ("" if chat else "; 0 only with echo"),
            )
        ),
        "max_completion_tokens": nullable(between("integer", 1, most_tokens, description="wins over max_tokens")),
        "stop": _stop(limits),
        "ignore_eos": nullable(BOOLEAN),
        "stop_token_ids": nullable({"type": "array", "maxItems": MAX_STOP_TOKEN_IDS, "items": token_id(limits)}),
        "stream": nullable(BOOLEAN),
        "stream_options": nullable(obj(include_usage=nullable(BOOLEAN))),
        "response_format": RESPONSE_FORMAT,
        "guided_json": nullable(JSON_SCHEMA_TEXT),
        "guided_regex": nullable(CONSTRAINT_TEXT),
        "guided_grammar": nullable({**CONSTRAINT_TEXT, "description": "Lark, or GBNF when it holds '::='"}),
        "guided_choice": nullable(CHOICES),
        "structured_outputs": STRUCTURED_OUTPUTS,
    }
    if chat:
        described |= {
            "messages": MESSAGES,
            "echo": {"enum": [False, None], "description": "a completions parameter"},
            "logprobs": nullable(BOOLEAN),
            "top_logprobs": nullable(between("integer", 0, limits.max_top_logprobs, description="needs logprobs")),
            "tools": nullable({"type": "array", "items": TOOL}),
            "tool_choice": TOOL_CHOICE,
            "parallel_tool_calls": nullable(BOOLEAN),
        }
    else:
        described |= {
            "prompt": _prompt(limits),
            "echo": nullable(BOOLEAN),
            "logprobs": nullable(between("integer", 0, limits.max_top_logprobs, description="alternatives per token")),
        }
    for name, kind in IGNORED.items():
        described[name] = nullable({"type": "object" if kind is dict else "string", "description": "ignored"})
    for name, neutral in NEUTRAL_ONLY[chat].items():
        described[name] = {"enum": [*neutral, None], "description": "not supported: only a value that asks for nothing"}
    return described


def request_schema(limits: Limits, chat: bool) -> Schema:
    """A /v1/chat/completions (or /v1/completions) body: only the fields ``parameters(chat)`` names."""
    described = parameter_schemas(limits, chat)
    if set(described) != parameters(chat):  # (a parameter added to the parser without its description)
        raise AssertionError(f"described but not read, or read but not described: {set(described) ^ parameters(chat)}")
    return {
        "type": "object",
        "required": ["messages" if chat else "prompt"],
        "properties": dict(sorted(described.items())),
        "additionalProperties": False,
    }


def tokenize_request(limits: Limits) -> Schema:
    return {
        "type": "object",
        "description": "exactly one of prompt and messages",
        "properties": {
            "model": nullable(STRING),
            "prompt": nullable(STRING),
            "messages": nullable(MESSAGES),
            "add_special_tokens": nullable(BOOLEAN),
            "add_generation_prompt": nullable(BOOLEAN),
            "return_token_strs": nullable(BOOLEAN),
        },
        "oneOf": [
            {"required": ["prompt"], "properties": {"prompt": STRING}},
            {"required": ["messages"], "properties": {"messages": {"type": "array"}}},
        ],
    }


def detokenize_request(limits: Limits) -> Schema:
    return obj("tokens", model=nullable(STRING), tokens={"type": "array", "items": token_id(limits)})


def lora_request(limits: Limits, path: bool) -> Schema:
    """vLLM's load (``path``) and unload bodies."""
    fields = ["lora_name", "lora_path"] if path else ["lora_name"]
    return {
        "type": "object",
        "required": fields,
        "properties": {name: {"type": "string", "minLength": 1} for name in fields},
    }
