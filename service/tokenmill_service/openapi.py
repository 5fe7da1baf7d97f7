"""The HTTP API described as OpenAPI 3.1, served at GET /openapi.json.

One ``Operation`` per route of http_api.py (a unit test holds the two lists equal): its request body's schema and
its answers, with the error statuses it can give. The request bodies' schemas live in openai_schema.py, beside the
parser whose rules they state, and take the server's limits, so the document says what this server enforces; the
answers' are in openai_response_schema.py. Describing a new route (/v1/embeddings, say) is one more ``Operation``
in ``OPERATIONS``: its method, path, summary, 200 content, request schema (a function of the limits) and error
statuses; tests/unit/test_openapi.py fails until every route has one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tokenmill_service import openai_response_schema as answers
from tokenmill_service import openai_schema as s
from tokenmill_service.validation import Limits

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
    type, ``errors`` the other statuses it gives (see ERRORS; 503 for /health's not ready)."""

    method: str
    path: str
    summary: str
    answer: dict[str, Any]
    body: Callable[[Limits], Schema] | None = None
    errors: tuple[int, ...] = ()
    auth: bool = True
    headers: tuple[str, ...] = ()


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
                "contentMediaType": "application/json",
                "contentSchema": {
                    "anyOf": [{"$ref": f"#/components/schemas/{chunk}"}, {"$ref": "#/components/schemas/Error"}]
                },
            }
        },
    }
    return {**_json(name), "text/event-stream": {"schema": events}}


OPERATIONS: tuple[Operation, ...] = (
    Operation(
        "POST",
        "/v1/chat/completions",
        "A chat's answer (OpenAI's chat completions)",
        _generation("ChatCompletion", "ChatCompletionChunk"),
        lambda limits: s.request_schema(limits, chat=True),
        GENERATION_ERRORS,
        headers=("x-request-id",),
    ),
    Operation(
        "POST",
        "/v1/completions",
        "A prompt's continuation (OpenAI's legacy completions)",
        _generation("Completion", "CompletionChunk"),
        lambda limits: s.request_schema(limits, chat=False),
        GENERATION_ERRORS,
        headers=("x-request-id",),
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
        error: dict[str, Any] = {"description": ERRORS[status], "content": _json("Error")}
        if status == 401:
            error["headers"] = {"www-authenticate": {"schema": {"const": "Bearer"}}}
        responses[str(status)] = error
    return responses


def _operation(op: Operation, limits: Limits) -> dict[str, Any]:
    described: dict[str, Any] = {
        "summary": op.summary,
        "operationId": op.method.lower() + op.path.replace("/", "_").replace(".", "_"),
        "responses": _responses(op),
    }
    if op.body is not None:
        described["requestBody"] = {"required": True, "content": {"application/json": {"schema": op.body(limits)}}}
    if not op.auth:
        described["security"] = []
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
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "tokenmill",
            "version": version,
            "description": "OpenAI's chat completions and completions, vLLM's tokenizer and LoRA routes, health and "
            "metrics. Every generation goes through the same validation, limits and admission as the gRPC API.",
        },
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        # The token is needed only where the server has one (--auth-token).
        "security": [{"bearer": []}, {}],
    }
