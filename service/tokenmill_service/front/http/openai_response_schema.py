"""The HTTP API's answers as JSON Schema, for /openapi.json: what openai_response.py's ResponseBuilder and
http_api.py's routes write (test_openapi_conformance.py checks each answer of a live server against them)."""

from __future__ import annotations

from tokenmill_service.front.http.openai_schema import BOOLEAN, INTEGER, NULL, STRING, Schema, nullable, obj

FINISH_REASON: Schema = {"enum": ["stop", "length", "tool_calls", None]}
USAGE: Schema = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {
        name: {"type": "integer", "minimum": 0} for name in ("prompt_tokens", "completion_tokens", "total_tokens")
    },
}
TOOL_CALL_OUT: Schema = obj(
    "id",
    "type",
    "function",
    index=INTEGER,
    id=STRING,
    type={"const": "function"},
    function=obj("name", "arguments", name=STRING, arguments=STRING),
)
_ALTERNATIVE: Schema = obj(
    "token", "logprob", "bytes", token=STRING, logprob={"type": "number"}, bytes={"type": "array", "items": INTEGER}
)
CHAT_LOGPROBS: Schema = nullable(
    obj(
        "content",
        content={
            "type": "array",
            "items": {
                **_ALTERNATIVE,
                "required": [*_ALTERNATIVE["required"], "top_logprobs"],
                "properties": {
                    **_ALTERNATIVE["properties"],
                    "top_logprobs": {"type": "array", "items": _ALTERNATIVE},
                },
            },
        },
    )
)
COMPLETION_LOGPROBS: Schema = nullable(
    {
        "type": "object",
        "description": "OpenAI's legacy shape; with echo the prompt's tokens come first (the first without a logprob)",
        "required": ["tokens", "token_logprobs", "top_logprobs", "text_offset"],
        "properties": {
            "tokens": {"type": "array", "items": STRING},
            "token_logprobs": {"type": "array", "items": {"type": ["number", "null"]}},
            "top_logprobs": {
                "type": "array",
                "items": {"type": ["object", "null"], "additionalProperties": {"type": "number"}},
            },
            "text_offset": {"type": "array", "items": INTEGER},
        },
    }
)
_MESSAGE_OUT_PROPERTIES: Schema = {
    "role": {"const": "assistant"},
    "content": nullable(STRING),
    "reasoning_content": STRING,
    "tool_calls": {"type": "array", "items": TOOL_CALL_OUT},
}


def _envelope(kind: str, choice: Schema, usage: Schema) -> Schema:
    return obj(
        "id",
        "object",
        "created",
        "model",
        "choices",
        id=STRING,
        object={"const": kind},
        created=INTEGER,
        model=STRING,
        choices={"type": "array", "items": choice},
        usage=usage,
    )


def _choice(**properties: Schema) -> Schema:
    return {
        "type": "object",
        "required": ["index", *properties, "finish_reason"],
        "properties": {"index": {"type": "integer", "minimum": 0}, **properties, "finish_reason": FINISH_REASON},
    }


CHAT_COMPLETION = _envelope(
    "chat.completion",
    _choice(
        message={"type": "object", "required": ["role", "content"], "properties": _MESSAGE_OUT_PROPERTIES},
        logprobs=CHAT_LOGPROBS,
    ),
    USAGE,
)
CHAT_COMPLETION_CHUNK = _envelope(
    "chat.completion.chunk",
    _choice(delta={"type": "object", "properties": _MESSAGE_OUT_PROPERTIES}, logprobs=CHAT_LOGPROBS),
    nullable(USAGE),
)
COMPLETION = _envelope("text_completion", _choice(text=STRING, logprobs=COMPLETION_LOGPROBS), USAGE)
COMPLETION_CHUNK = _envelope("text_completion", _choice(text=STRING, logprobs=COMPLETION_LOGPROBS), nullable(USAGE))

MODELS: Schema = obj(
    "object",
    "data",
    object={"const": "list"},
    data={
        "type": "array",
        "items": obj(
            "id",
            "object",
            "created",
            "owned_by",
            "parent",
            id=STRING,
            object={"const": "model"},
            created=INTEGER,
            owned_by=STRING,
            root={"type": "string", "description": "a LoRA adapter's path"},
            parent={"type": ["string", "null"], "description": "a LoRA adapter's base model"},
        ),
    },
)
TOKENIZE_RESPONSE: Schema = obj(
    "count",
    "max_model_len",
    "tokens",
    "token_strs",
    count=INTEGER,
    max_model_len=INTEGER,
    tokens={"type": "array", "items": INTEGER},
    token_strs={"type": ["array", "null"], "items": STRING},
)
DETOKENIZE_RESPONSE: Schema = obj("prompt", prompt=STRING)
TOKENIZER_INFO: Schema = obj(
    "tokenizer_class",
    "eos_token",
    "bos_token",
    "add_bos_token",
    "chat_template",
    "model_max_length",
    tokenizer_class=STRING,
    eos_token=STRING,
    bos_token=nullable(STRING),
    pad_token=NULL,
    add_bos_token=BOOLEAN,
    chat_template=nullable(STRING),
    model_max_length=INTEGER,
    vocab_size=INTEGER,
)
HEALTH: Schema = obj("status", status={"enum": ["ready", "not ready"]})
ERROR: Schema = obj(
    "error",
    error=obj(
        "message",
        "type",
        "param",
        "code",
        message=STRING,
        type={"type": "string", "description": "invalid_request_error, authentication_error, ..."},
        param={"type": ["string", "null"], "description": "the parameter at fault, as the request named it"},
        code={"type": ["string", "null"], "description": "what is wrong: invalid_value, ..."},
    ),
)
