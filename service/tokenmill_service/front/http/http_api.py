"""The OpenAI-compatible HTTP front-end: Starlette routes served by uvicorn on the server's own loop.

    POST /v1/chat/completions, POST /v1/completions   (server-sent events when "stream": true)
    POST /v1/messages, POST /v1/messages/count_tokens  (Anthropic's Messages API: anthropic_protocol.py)
    POST /v1/responses                                 (OpenAI's Responses API: responses_protocol.py)
    POST /v1/embeddings                                (OpenAI's embeddings: embeddings_api.py)
    GET  /v1/models, GET /health (200 ready, 503 not; open), GET /metrics (Prometheus; behind the
         token like the rest unless --metrics-without-auth), GET /openapi.json (this API described; open)
    POST /tokenize, POST /detokenize, GET /tokenizer_info   (vLLM's shapes; lm-evaluation-harness
                                                            tokenizes through them)

Every generation goes through the same GenerationService as gRPC (auth, validation, limits,
admission, metrics, the request_finished log line), and answers with a GenerationResponse
(generation_response.py): its status waits for the first engine output, so that a refusal is a
plain error response in OpenAI's JSON (http_errors.py), never a broken stream. uvicorn serves
these routes (http_server.py).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc
import structlog
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tokenmill_service import __version__
from tokenmill_service.front.generation import GenerationService, ServiceError
from tokenmill_service.front.http import openapi
from tokenmill_service.front.http.anthropic_protocol import MESSAGES, count_tokens_json, parse_messages
from tokenmill_service.front.http.anthropic_protocol import error_body as anthropic_error
from tokenmill_service.front.http.dialect import CHAT, COMPLETIONS, Dialect
from tokenmill_service.front.http.embeddings_api import create_embeddings
from tokenmill_service.front.http.embeddings_protocol import parse_embeddings
from tokenmill_service.front.http.generation_response import GenerationResponse
from tokenmill_service.front.http.http_body import read_body
from tokenmill_service.front.http.http_errors import (
    error_response,
    json_error,
    refusal_json,
    refusal_response,
    service_error_json,
)
from tokenmill_service.front.http.openai_errors import openai_error
from tokenmill_service.front.http.openai_protocol import ParsedRequest
from tokenmill_service.front.http.request_fields import BadRequest
from tokenmill_service.front.http.responses_protocol import RESPONSES
from tokenmill_service.front.http.tokenize_protocol import parse_detokenize, parse_tokenize
from tokenmill_service.front.proto import pb
from tokenmill_service.front.validation import InvalidRequest, Limits, chat_messages, check_token_ids, prompt_ids

log = structlog.get_logger("tokenmill.http")

AUTH_WHERE = "the Authorization header"
# Bodies over this many bytes are read as JSON and checked off the event loop: a chat of 100,000 short messages
# (3.5 MB) takes about 0.3 s to decode and parse, and no health check or stream should wait on it.
OFF_LOOP_BYTES = 64 * 1024
Parsed = TypeVar("Parsed")


def _decoded(body: bytes) -> Any:
    """The body as JSON (BadRequest naming what is wrong with it)."""
    try:
        return json.loads(body or b"null")
    except json.JSONDecodeError as exc:
        raise BadRequest(f"the body is not valid JSON: {exc}", code="invalid_json") from None
    except UnicodeDecodeError as exc:  # (json.loads reads bytes as UTF-8, -16 or -32, by their first bytes)
        raise BadRequest(f"the body is not JSON in UTF-8: {exc}", code="invalid_json") from None
    except RecursionError:
        raise BadRequest("the body's JSON is nested too deeply to read", code="invalid_json") from None


def _string_field(body: Any, name: str) -> str:
    value = body.get(name) if isinstance(body, dict) else None
    if not isinstance(value, str) or not value:
        raise BadRequest(f"'{name}' is required: a non-empty string", name, "missing_required_parameter")
    return value


class HttpApi:
    """The routes, bound to one GenerationService."""

    def __init__(self, service: GenerationService) -> None:
        self.service = service
        self.app = Starlette(
            routes=[
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/messages", self._dialect(MESSAGES), methods=["POST"]),
                Route("/v1/messages/count_tokens", self.count_tokens, methods=["POST"]),
                Route("/v1/responses", self._dialect(RESPONSES), methods=["POST"]),
                Route("/v1/embeddings", self.embeddings, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/load_lora_adapter", self.load_lora_adapter, methods=["POST"]),
                Route("/v1/unload_lora_adapter", self.unload_lora_adapter, methods=["POST"]),
                Route("/tokenize", self.tokenize, methods=["POST"]),
                Route("/detokenize", self.detokenize, methods=["POST"]),
                # Beside the root routes, where clients of vLLM's newer servers look for them.
                Route("/v1/tokenize", self.tokenize, methods=["POST"]),
                Route("/v1/detokenize", self.detokenize, methods=["POST"]),
                Route("/tokenizer_info", self.tokenizer_info, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/metrics", self.metrics, methods=["GET"]),
                Route("/openapi.json", self.openapi, methods=["GET"]),
            ],
            exception_handlers={404: self._not_found, 405: self._not_allowed, Exception: self._internal_error},
        )

    async def _internal_error(self, request: Request, exc: Exception) -> Response:
        """A bug of ours: logged with its traceback, answered in OpenAI's shape (not a plain-text 500)."""
        log.error("http_internal_error", path=request.url.path, error=repr(exc), exc_info=exc)
        return error_response(500, "server_error", f"internal error: {type(exc).__name__}", code="internal_error")

    async def _not_found(self, request: Request, exc: Exception) -> Response:
        return error_response(
            404, "not_found_error", f"no route {request.method} {request.url.path}", code="unknown_url"
        )

    async def _not_allowed(self, request: Request, exc: Exception) -> Response:
        message = f"{request.method} is not allowed on {request.url.path}"
        return error_response(405, "invalid_request_error", message, code="method_not_allowed")

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, CHAT)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, COMPLETIONS)

    def _dialect(self, dialect: Dialect) -> Callable[[Request], Awaitable[Response]]:
        """The route of another API served through the chat path (anthropic_protocol.py, responses_protocol.py)."""

        async def endpoint(request: Request) -> Response:
            return await self._generate(request, dialect)

        return endpoint

    async def _generate(self, request: Request, dialect: Dialect) -> Response:
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        try:
            parsed: ParsedRequest = await self._parsed_body(request, dialect.parse, dialect)
        except (ServiceError, ValueError, RecursionError) as exc:
            status, body = refusal_json(exc)
            return json_error(status, dialect.builder.error_body(status, body))
        adapter = self._adapter(parsed.model)
        many = len(parsed.requests) > 1
        authorization, where = self._authorization(request, dialect)
        streams = []
        for i, one in enumerate(parsed.requests):
            # Each prompt is its own sequence, under its own id (the engine refuses two alike).
            one.request_id = f"{request_id}-{i}" if many else request_id
            one.adapter = adapter
            streams.append(self.service.generate(one, one.request_id, authorization, where, api="http"))
        echo_texts = [self._prompt_text(one) for one in parsed.requests] if parsed.echo else []
        builder = dialect.builder(parsed, request_id, adapter or self.service.model_name(), echo_texts)
        return GenerationResponse(streams, builder, request_id)

    async def embeddings(self, request: Request) -> Response:
        """OpenAI's embeddings (embeddings_protocol.py parses, embeddings_api.py answers)."""
        try:
            parsed = await self._parsed_body(request, parse_embeddings)
            return JSONResponse(await create_embeddings(self.service, parsed, self._adapter(parsed.model)))
        except (ServiceError, BadRequest) as exc:
            return refusal_response(exc)

    async def count_tokens(self, request: Request) -> Response:
        """Anthropic's: the tokens of the prompt /v1/messages makes of the body (tools included)."""
        names: dict[str, str] = {}
        try:
            parsed = await self._parsed_body(request, lambda body: parse_messages(body, count_only=True), MESSAGES)
            names = parsed.field_names
            vocab_size = self.service.limits().vocab_size
            ids = await asyncio.to_thread(prompt_ids, parsed.request, self.service.tokenizer, vocab_size)
        except InvalidRequest as exc:
            status, body = service_error_json(
                ServiceError(grpc.StatusCode.INVALID_ARGUMENT, str(exc), exc.field, exc.code), names
            )
        except (ServiceError, ValueError, RecursionError) as exc:
            status, body = refusal_json(exc)
        else:
            return JSONResponse(count_tokens_json(len(ids)))
        return json_error(status, anthropic_error(status, body))

    def _adapter(self, model: str) -> str:
        """The LoRA adapter a request's ``model`` names ("": the base). With adapters on (--max-loras), a
        name that is neither the base model's nor a loaded adapter's is passed on, to be refused as
        not found; with them off, any name means the one model served."""
        if model in self.service.router.adapters.served:
            return model
        if self.service.settings.max_loras and model and model != self.service.model_name():
            return model
        return ""

    def _prompt_text(self, request: pb.GenerateRequest) -> str:
        """What echo repeats: the prompt as given, or its token ids' text."""
        if request.WhichOneof("input") == "token_ids":
            return self.service.tokenizer.decode(request.token_ids.ids)
        return request.prompt

    async def models(self, request: Request) -> Response:
        if (refused := self._unauthorized(request)) is not None:
            return refused
        name = self.service.model_name()
        data = [{"id": name, "object": "model", "created": 0, "owned_by": "tokenmill", "parent": None}] if name else []
        for adapter, path in sorted(self.service.router.adapters.served.items()):
            data.append(
                {"id": adapter, "object": "model", "created": 0, "owned_by": "tokenmill", "root": path, "parent": name}
            )
        return JSONResponse({"object": "list", "data": data})

    async def load_lora_adapter(self, request: Request) -> Response:
        """vLLM's shape: {"lora_name": ..., "lora_path": ...}; every worker loads it."""
        try:
            body = await self._json_body(request)
            name, path = _string_field(body, "lora_name"), _string_field(body, "lora_path")
            await self.service.load_adapter(name, path, request.headers.get("authorization"), AUTH_WHERE)
        except (ServiceError, BadRequest) as exc:
            return refusal_response(exc)
        return Response(f"Success: LoRA adapter '{name}' added successfully.", media_type="text/plain")

    async def unload_lora_adapter(self, request: Request) -> Response:
        """vLLM's shape: {"lora_name": ...}; refused (409) while requests use it."""
        try:
            name = _string_field(await self._json_body(request), "lora_name")
            await self.service.unload_adapter(name, request.headers.get("authorization"), AUTH_WHERE)
        except (ServiceError, BadRequest) as exc:
            return refusal_response(exc)
        return Response(f"Success: LoRA adapter '{name}' removed successfully.", media_type="text/plain")

    def _unauthorized(self, request: Request) -> Response | None:
        """The refusal of a caller without the token (None: it may go on)."""
        try:
            self.service.authorize(request.headers.get("authorization"), AUTH_WHERE)
        except ServiceError as exc:
            return refusal_response(exc)
        return None

    def _authorization(self, request: Request, dialect: Dialect) -> tuple[str | None, str]:
        """The caller's Authorization value and where a refusal says the token goes; a dialect's own key
        header (the anthropic SDK's x-api-key) stands in for a bearer token."""
        authorization = request.headers.get("authorization")
        if dialect.key_header is None:
            return authorization, AUTH_WHERE
        key = request.headers.get(dialect.key_header)
        if key is not None and not self.service.authorized(authorization):
            authorization = f"Bearer {key}"
        return authorization, f"{AUTH_WHERE} or {dialect.key_header}"

    async def _json_body(self, request: Request, dialect: Dialect = CHAT) -> Any:
        """The body as JSON, read only after the caller's token is checked and only up to --max-request-bytes
        (ServiceError, BodyTooLarge or BadRequest otherwise)."""
        return await self._parsed_body(request, lambda body: body, dialect)

    async def _parsed_body(self, request: Request, parse: Callable[[Any], Parsed], dialect: Dialect = CHAT) -> Parsed:
        """``parse`` of the body as JSON (as ``_json_body``), a large body's off the event loop."""
        self.service.authorize(*self._authorization(request, dialect))
        body = await read_body(request, self.service.settings.request_bytes_limit)
        if len(body) > OFF_LOOP_BYTES:
            return await asyncio.to_thread(lambda: parse(_decoded(body)))
        return parse(_decoded(body))

    async def tokenize(self, request: Request) -> Response:
        tokenizer = self.service.tokenizer
        try:
            body = await self._parsed_body(request, parse_tokenize)
            if body.chat is not None:
                chat = chat_messages(body.chat, tokenizer)[0]
                ids = await asyncio.to_thread(tokenizer.encode_chat, chat, body.add_generation_prompt)
            else:
                ids = await asyncio.to_thread(tokenizer.encode, body.prompt or "")  # off the event loop
                if body.add_special_tokens and tokenizer.add_bos and tokenizer.bos_token_id is not None:
                    ids = [tokenizer.bos_token_id, *ids]
        except (ServiceError, BadRequest) as exc:
            return refusal_response(exc)
        except InvalidRequest as exc:
            message, param = openai_error(str(exc), exc.field)
            return error_response(400, "invalid_request_error", message, param, exc.code)
        except ValueError as exc:  # a chat the template refuses
            return error_response(400, "invalid_request_error", str(exc), "messages", "invalid_value")
        reply: dict[str, Any] = {
            "count": len(ids),
            "max_model_len": self.service.context_length() or 0,
            "tokens": ids,
            "token_strs": [tokenizer.token_text(i) for i in ids] if body.return_token_strs else None,
        }
        return JSONResponse(reply)

    async def detokenize(self, request: Request) -> Response:
        tokenizer = self.service.tokenizer
        try:
            ids = await self._parsed_body(request, parse_detokenize)
            check_token_ids("tokens", ids, tokenizer.vocab_size)
        except (ServiceError, BadRequest) as exc:
            return refusal_response(exc)
        except InvalidRequest as exc:
            return error_response(400, "invalid_request_error", str(exc), "tokens", exc.code)
        return JSONResponse({"prompt": tokenizer.decode(ids)})

    async def tokenizer_info(self, request: Request) -> Response:
        """What a client needs to tokenize as the server does (vLLM's route): the special tokens' text
        and the chat template. lm-evaluation-harness finds it and then sends token ids."""
        if (refused := self._unauthorized(request)) is not None:
            return refused
        tokenizer = self.service.tokenizer
        bos = tokenizer.bos_token_id
        return JSONResponse(
            {
                "tokenizer_class": "tokenmill",
                "eos_token": tokenizer.token_text(tokenizer.eos_token_id),
                "bos_token": None if bos is None else tokenizer.token_text(bos),
                "pad_token": None,
                "add_bos_token": tokenizer.add_bos,
                "chat_template": tokenizer.chat_template,
                "model_max_length": self.service.context_length() or 0,
                "vocab_size": tokenizer.vocab_size,
            }
        )

    async def health(self, request: Request) -> Response:
        if self.service.router.ready:
            return JSONResponse({"status": "ready"})
        return JSONResponse({"status": "not ready"}, status_code=503)

    async def metrics(self, request: Request) -> Response:
        refused = None if self.service.settings.metrics_without_auth else self._unauthorized(request)
        if refused is not None:
            return refused
        return Response(generate_latest(self.service.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def openapi(self, request: Request) -> Response:
        """Every route described (openapi.py), with this server's limits."""
        try:
            limits = self.service.limits()
        except ServiceError:  # still loading: the model's own bounds are not known yet
            limits = Limits.from_settings(self.service.settings)
        return JSONResponse(openapi.document(limits, __version__))
