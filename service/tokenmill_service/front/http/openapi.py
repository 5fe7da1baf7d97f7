"""The HTTP API described as OpenAPI 3.1, served at GET /openapi.json.

One ``Operation`` per route of http_api.py (a unit test holds the two lists equal): its request body's schema and
its answers, with the error statuses it can give. The request bodies' schemas live in openai_schema.py, beside the
parser whose rules they state, and take the server's limits, so the document says what this server enforces; the
answers' are in openai_response_schema.py. The other APIs served through the chat path have a module each, bodies
and answers: anthropic_schema.py (the Messages API, its errors in Anthropic's shape) and responses_schema.py (the
Responses API); embeddings_schema.py describes OpenAI's embeddings. Describing a new route is one more
``Operation`` in ``OPERATIONS``: its method, path, summary, 200 content, request schema (a function of the limits)
and error statuses; tests/unit/test_openapi.py fails until every route has one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tokenmill_service.front.http import anthropic_schema as anthropic
from tokenmill_service.front.http import embeddings_schema as embeddings
from tokenmill_service.front.http import openai_response_schema as answers
from tokenmill_service.front.http import openai_schema as s
from tokenmill_service.front.http import responses_schema as responses
from tokenmill_service.front.http.anthropic_protocol import MESSAGES
from tokenmill_service.front.validation import Limits

Schema = dict[str, Any]

# Each error status an operation may answer, with what it means here.
ERRORS: dict[int, str] = {
    400: "the request is invalid: the message names the parameter (also in param), code says what is wrong",
    401: "a missing or wrong bearer token (Authorization: Bearer TOKEN), when the server has one",
    404: "no such model: a LoRA adapter that is not loaded",
    409: "the adapter is in use by requests in flight; retry when they finish",
    413: "the body is over --max-request-bytes (refused before it is read)",
    429: "the queue is full; retry later",
    503: "the server is draining, still loading its model, or has no worker",
    504: "the request's deadline passed",
}
GENERATION_ERRORS = (400, 401, 404, 413, 429, 503, 504)
TEXT = {"text/plain": {"schema": s.STRING}}


@dataclass(frozen=True, slots=True)
class Operation:
    """One route: ``body`` is its JSON request body's schema (None: no body), ``answer`` its 200 content by media
    type, ``errors`` the other statuses it gives (see ERRORS; 503 for /health's not ready), each with the body
    ``error`` gives for it (None: OpenAI's Error); ``key_header`` a header that may carry the token instead of
    the bearer one."""

    method: str
    path: str
    summary: str
    answer: dict[str, Any]
    body: Callable[[Limits], Schema] | None = None
    errors: tuple[int, ...] = ()
    auth: bool = True
    headers: tuple[str, ...] = ()
    error: Callable[[int], Schema] | None = None
    key_header: str | None = None
    examples: dict[str, Any] | None = None


def _examples(summary: str, body: dict[str, Any], stream: bool = True) -> dict[str, Any]:
    """A body's example, and the same one streamed."""
    examples = {"whole": {"summary": summary, "value": body}}
    if stream:
        examples["stream"] = {"summary": summary + ", streamed", "value": {**body, "stream": True}}
    return examples


FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def _json(name: str) -> dict[str, Any]:
    return {"application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}}


def _generation(name: str, chunk: str) -> dict[str, Any]:
    # (OpenAPI 3.1: the schema of a text/event-stream describes each event.)
    events = {
        "type": "object",
        "required": ["data"],
        "properties": {
            "data": {
                "type": "string",
                "description": f"a {chunk} as JSON; the last event's data is [DONE]; an error after the status was "
                "sent comes as an event holding an Error",
                "if": {"const": "[DONE]"},
                "else": {
                    "contentMediaType": "application/json",
                    "contentSchema": {
                        "anyOf": [{"$ref": f"#/components/schemas/{chunk}"}, {"$ref": "#/components/schemas/Error"}]
                    },
                },
            }
        },
    }
    return {**_json(name), "text/event-stream": {"schema": events}}


def _named_events(name: str, events: dict[str, Schema]) -> dict[str, Any]:
    """The whole answer, or (``stream``) its events, each named by its type (``event: TYPE``) and its data that
    type's JSON; the stream ends with the last event."""
    each = {
        "type": "object",
        "description": "a failure after the status was sent comes as the error event",
        "required": ["event", "data"],
        "properties": {"event": {"enum": list(events)}, "data": s.STRING},
        "allOf": [
            {
                "if": {"properties": {"event": {"const": kind}}},
                "then": {"properties": {"data": {"contentMediaType": "application/json", "contentSchema": schema}}},
            }
            for kind, schema in events.items()
        ],
    }
    return {**_json(name), "text/event-stream": {"schema": each}}


def _generating(
    path: str,
    summary: str,
    answer: dict[str, Any],
    body: Callable[[Limits], Schema],
    examples: dict[str, Any],
    **dialect: Any,
) -> Operation:
    """A route that generates: a POST whose answer carries its request's id, refused as every generation is
    (``dialect``: the error shape and key header of another API served through the chat path)."""
    return Operation(
        "POST", path, summary, answer, body, GENERATION_ERRORS, headers=("x-request-id",), examples=examples, **dialect
    )


OPERATIONS: tuple[Operation, ...] = (
    _generating(
        "/v1/chat/completions",
        "A chat's answer (OpenAI's chat completions)",
        _generation("ChatCompletion", "ChatCompletionChunk"),
        lambda limits: s.request_schema(limits, chat=True),
        _examples("A question", {"messages": FRANCE, "max_tokens": 16}),
    ),
    _generating(
        "/v1/completions",
        "A prompt's continuation (OpenAI's legacy completions)",
        _generation("Completion", "CompletionChunk"),
        lambda limits: s.request_schema(limits, chat=False),
        _examples("A prompt", {"prompt": "The capital of France is", "max_tokens": 16}),
    ),
    _generating(
        "/v1/messages",
        "A chat's answer (Anthropic's Messages API)",
        _named_events("Message", anthropic.EVENTS),
        anthropic.request_schema,
        _examples("A question", {"max_tokens": 16, "system": "Answer in one sentence.", "messages": FRANCE}),
        error=anthropic.error,
        key_header=MESSAGES.key_header,
    ),
    Operation(
        "POST",
        "/v1/messages/count_tokens",
        "The tokens of the prompt a Messages body makes, tools included (Anthropic's)",
        _json("MessageTokensCount"),
        lambda limits: anthropic.request_schema(limits, count_only=True),
        (400, 401, 413, 503),
        error=anthropic.error,
        key_header=MESSAGES.key_header,
        examples=_examples("A question", {"system": "Answer in one sentence.", "messages": FRANCE}, stream=False),
    ),
    _generating(
        "/v1/responses",
        "A response, without server-side state (OpenAI's Responses API)",
        _named_events("Response", responses.EVENTS),
        responses.request_schema,
        _examples(
            "A question",
            {"instructions": "Answer in one sentence.", "input": FRANCE[0]["content"], "max_output_tokens": 16},
        ),
    ),
    Operation(
        "POST",
        "/v1/embeddings",
        "Each input's vector (OpenAI's embeddings; the model must embed: an encoder or a pooling checkpoint)",
        _json("Embeddings"),
        embeddings.request_schema,
        (400, 401, 404, 413, 429, 503),  # (no example body: the default model, a chat model, refuses it)
    ),
    Operation("GET", "/v1/models", "The model served, and its LoRA adapters", _json("Models"), errors=(401,)),
    Operation(
        "POST",
        "/v1/load_lora_adapter",
        "Serve a LoRA adapter (a PEFT directory on the server) on every worker, as a model name (vLLM's route)",
        TEXT,
        lambda limits: s.lora_request(limits, path=True),
        (400, 401, 413, 503),
    ),
    Operation(
        "POST",
        "/v1/unload_lora_adapter",
        "Stop serving a LoRA adapter (vLLM's route)",
        TEXT,
        lambda limits: s.lora_request(limits, path=False),
        (400, 401, 404, 409, 413, 503),
    ),
    Operation(
        "POST",
        "/tokenize",
        "Text, or a chat rendered with the model's template, as token ids (vLLM's route)",
        _json("TokenizeResponse"),
        s.tokenize_request,
        (400, 401, 413),
    ),
    Operation(
        "POST",
        "/detokenize",
        "Token ids as text (vLLM's route)",
        _json("DetokenizeResponse"),
        s.detokenize_request,
        (400, 401, 413),
    ),
    Operation(
        "POST",
        "/v1/tokenize",
        "/tokenize under /v1, as vLLM's newer servers have it",
        _json("TokenizeResponse"),
        s.tokenize_request,
        (400, 401, 413),
    ),
    Operation(
        "POST",
        "/v1/detokenize",
        "/detokenize under /v1, as vLLM's newer servers have it",
        _json("DetokenizeResponse"),
        s.detokenize_request,
        (400, 401, 413),
    ),
    Operation(
        "GET",
        "/tokenizer_info",
        "The special tokens' text and the chat template (vLLM's route)",
        _json("TokenizerInfo"),
        errors=(401,),
    ),
    Operation("GET", "/health", "200 once the model serves, 503 before", _json("Health"), errors=(503,), auth=False),
    Operation(
        "GET",
        "/metrics",
        "Prometheus metrics (behind the token unless --metrics-without-auth)",
        TEXT,
        errors=(401,),
    ),
    Operation(
        "GET", "/openapi.json", "This document", {"application/json": {"schema": {"type": "object"}}}, auth=False
    ),
)


def _responses(op: Operation) -> dict[str, Any]:
    ok: dict[str, Any] = {"description": "OK", "content": op.answer}
    if op.headers:
        ok["headers"] = {name: {"schema": s.STRING} for name in op.headers}
    responses: dict[str, Any] = {"200": ok}
    for status in op.errors:
        if op.path == "/health" and status == 503:
            responses["503"] = {"description": "not ready (loading, or no worker)", "content": _json("Health")}
            continue
        content = _json("Error") if op.error is None else {"application/json": {"schema": op.error(status)}}
        error: dict[str, Any] = {"description": ERRORS[status], "content": content}
        if status == 400 and op.error is not None:  # (an error of another shape has no param or code)
            error["description"] = "the request is invalid: the message names the parameter"
        if status == 401:
            error["headers"] = {"www-authenticate": {"schema": {"const": "Bearer"}}}
            if op.key_header:
                error["description"] = (
                    f"a missing or wrong token (Authorization: Bearer TOKEN, or the {op.key_header} header), when "
                    "the server has one"
                )
        responses[str(status)] = error
    return responses


def _operation(op: Operation, limits: Limits) -> dict[str, Any]:
    described: dict[str, Any] = {
        "summary": op.summary,
        "operationId": op.method.lower() + op.path.replace("/", "_").replace(".", "_"),
        "responses": _responses(op),
    }
    if op.body is not None:
        body: dict[str, Any] = {"schema": op.body(limits)}
        if op.examples:
            body["examples"] = op.examples
        described["requestBody"] = {"required": True, "content": {"application/json": body}}
    if not op.auth:
        described["security"] = []
    elif op.key_header:
        described["security"] = [{"bearer": []}, {op.key_header: []}, {}]
    return described


def document(limits: Limits, version: str) -> dict[str, Any]:
    """The whole API; ``limits`` are the server's (a vocabulary size of 0: not known yet, its bounds left out)."""
    paths: dict[str, Any] = {}
    for op in OPERATIONS:
        paths.setdefault(op.path, {})[op.method.lower()] = _operation(op, limits)
    schemas = {
        "ChatCompletion": answers.CHAT_COMPLETION,
        "ChatCompletionChunk": answers.CHAT_COMPLETION_CHUNK,
        "Completion": answers.COMPLETION,
        "CompletionChunk": answers.COMPLETION_CHUNK,
        "Models": answers.MODELS,
        "TokenizeResponse": answers.TOKENIZE_RESPONSE,
        "DetokenizeResponse": answers.DETOKENIZE_RESPONSE,
        "TokenizerInfo": answers.TOKENIZER_INFO,
        "Health": answers.HEALTH,
        "Error": answers.ERROR,
        "Message": anthropic.MESSAGE,
        "MessageTokensCount": anthropic.COUNT_TOKENS,
        "Response": responses.RESPONSE,
        "Embeddings": embeddings.EMBEDDINGS,
    }
    schemes: dict[str, Any] = {"bearer": {"type": "http", "scheme": "bearer"}}
    for op in OPERATIONS:
        if op.key_header:
            schemes[op.key_header] = {"type": "apiKey", "in": "header", "name": op.key_header}
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "tokenmill",
            "version": version,
            "description": "OpenAI's chat completions, completions and embeddings, Anthropic's Messages API, OpenAI's "
            "Responses API, vLLM's tokenizer and LoRA routes, health and metrics. Every generation goes through the same "
            "validation, limits and admission as the gRPC API.",
        },
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": schemes,
        },
        # The token is needed only where the server has one (--auth-token).
        "security": [{"bearer": []}, {}],
    }
