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
admission, metrics, the request_finished log line). A response's status is only sent once the
first engine output arrived, so a refusal (400, 401, 429, 503, 504) is always a plain error
response in OpenAI's JSON, never a broken stream. A client that disconnects cancels its request
in the worker at once (its connection is watched, not only noticed at the next write).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

import grpc
import structlog
import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from tokenmill_service import __version__, openapi
from tokenmill_service.anthropic_protocol import MESSAGES, count_tokens_json, parse_messages
from tokenmill_service.anthropic_protocol import error_body as anthropic_error
from tokenmill_service.embeddings_api import create_embeddings
from tokenmill_service.embeddings_protocol import parse_embeddings
from tokenmill_service.generation import GenerationService, ServiceError
from tokenmill_service.openai_protocol import (
    CHAT,
    COMPLETIONS,
    BadRequest,
    Dialect,
    ParsedRequest,
    ResponseBuilder,
    error_json,
    openai_error,
    parse_detokenize,
    parse_tokenize,
)
from tokenmill_service.proto import pb
from tokenmill_service.responses_protocol import RESPONSES
from tokenmill_service.validation import InvalidRequest, Limits, chat_messages, check_token_ids, prompt_ids

log = structlog.get_logger("tokenmill.http")

AUTH_WHERE = "the Authorization header"

# gRPC status -> (HTTP status, OpenAI error type, OpenAI error code unless the error says a closer one)
_HTTP_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", "invalid_value"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error", "invalid_api_key"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "rate_limit_exceeded"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error", "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error", "timeout"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error", "model_not_found"),
    grpc.StatusCode.FAILED_PRECONDITION: (409, "invalid_request_error", "adapter_in_use"),
}
_SERVER_ERROR = (500, "server_error", "internal_error")

T = TypeVar("T")


class Disconnected(Exception):
    pass


def error_response(
    status: int, kind: str, message: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    # RFC 9110: a 401 names the scheme the caller must use.
    headers = {"www-authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(error_json(message, kind, param, code), status_code=status, headers=headers)


def bad_request(exc: BadRequest) -> JSONResponse:
    return error_response(
        413 if isinstance(exc, BodyTooLarge) else 400, "invalid_request_error", str(exc), exc.param, exc.code
    )


def service_error_json(exc: ServiceError, names: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    """The HTTP status and OpenAI error of a failed call. validation.py names the gRPC request's fields;
    the caller is told them by the names it used (``names``: ParsedRequest.field_names)."""
    status, kind, code = _HTTP_ERRORS.get(exc.code, _SERVER_ERROR)
    message, param = openai_error(exc.message, exc.field, names)
    return status, error_json(message, kind, param, exc.reason or code)


def refusal_json(exc: ServiceError | ValueError | RecursionError) -> tuple[int, dict[str, Any]]:
    """The HTTP status and OpenAI error of a request refused before it reached the service."""
    if isinstance(exc, ServiceError):
        return service_error_json(exc)
    if isinstance(exc, BadRequest):
        return 413 if isinstance(exc, BodyTooLarge) else 400, error_json(
            str(exc), "invalid_request_error", exc.param, exc.code
        )
    if isinstance(exc, RecursionError):  # (a body within the size limit can still nest deeper than Python recurses)
        return 400, error_json("the request is nested too deeply", "invalid_request_error", code="invalid_value")
    # A value protobuf refuses, e.g. an integer out of range.
    return 400, error_json(str(exc), "invalid_request_error", code="invalid_value")


def service_error_response(exc: ServiceError, names: dict[str, str] | None = None) -> JSONResponse:
    status, body = service_error_json(exc, names)
    headers = {"www-authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(body, status_code=status, headers=headers)


class BodyTooLarge(BadRequest):
    """A request body over --max-request-bytes (413)."""

    def __init__(self, limit: int) -> None:
        super().__init__(
            f"the request body is over this server's limit of {limit} bytes (--max-request-bytes)",
            code="request_too_large",
        )


# A body over the limit is read to its end and dropped (no copy kept, nothing parsed) up to this size, so that the
# client, still sending, reads the 413 rather than a reset connection; a larger one is cut off.
DRAIN_BYTES = 64 * 1024 * 1024


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body, refused (BodyTooLarge) once it is known to pass ``limit`` bytes: by its
    Content-Length or as it arrives. Only up to ``limit`` bytes are ever kept."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max(limit, DRAIN_BYTES):
        raise BodyTooLarge(limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > DRAIN_BYTES:
            break
        if size <= limit:
            chunks.append(chunk)
    if size > limit:
        raise BodyTooLarge(limit)
    return b"".join(chunks)


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(receive: Receive, work: Awaitable[T]) -> T:
    """Run `work`, cancelling it (and raising Disconnected) if the client goes away first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            raise Disconnected
        return task.result()
    finally:
        watcher.cancel()
        if not task.done():  # this handler itself was cancelled
            task.cancel()


class GenerationResponse(Response):
    """Runs a request's generation (one per prompt of a completions list) while it answers: the status
    waits for the first output (see module doc)."""

    def __init__(
        self, responses: Sequence[AsyncIterator[pb.GenerateResponse]], builder: ResponseBuilder, request_id: str
    ):
        self.all_responses = responses
        self.builder = builder
        self.headers_ = {"x-request-id": request_id}
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        with contextlib.suppress(Disconnected):
            # One task for the whole generation: its log lines share the request's context variables.
            await until_disconnect(receive, self._respond(scope, receive, send))

    async def _respond(self, scope: Scope, receive: Receive, send: Send) -> None:
        if len(self.all_responses) > 1:
            await self._respond_many(scope, receive, send)
            return
        async with contextlib.aclosing(self.all_responses[0]) as responses:  # type: ignore[type-var]
            try:
                first = await anext(responses)
            except ServiceError as exc:
                await self._error(exc)(scope, receive, send)
                return
            if self.builder.parsed.stream:
                await self._stream(first, responses, send)
                return
            try:
                rest = [r async for r in responses]
            except ServiceError as exc:
                await self._error(exc)(scope, receive, send)
                return
            await JSONResponse(self.builder.whole([[first, *rest]]), headers=self.headers_)(scope, receive, send)

    async def _respond_many(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Several prompts, run side by side (the router batches them); the first failure fails them all."""

        async def collect(stream: AsyncIterator[pb.GenerateResponse]) -> list[pb.GenerateResponse]:
            async with contextlib.aclosing(stream) as responses:  # type: ignore[type-var]
                return [r async for r in responses]

        tasks = [asyncio.ensure_future(collect(r)) for r in self.all_responses]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for task in tasks:  # a failure (or this handler's cancellation) ends the others
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        failed = next((t for t in tasks if not t.cancelled() and t.exception() is not None), None)
        if failed is not None:
            error = failed.exception()
            if not isinstance(error, ServiceError):
                raise error  # type: ignore[misc]
            await self._error(error)(scope, receive, send)
            return
        whole = self.builder.whole([t.result() for t in tasks])
        await JSONResponse(whole, headers=self.headers_)(scope, receive, send)

    def _error(self, exc: ServiceError) -> Response:
        status, body = service_error_json(exc, self.builder.parsed.field_names)
        headers = {**self.headers_, "www-authenticate": "Bearer"} if status == 401 else self.headers_
        return JSONResponse(self.builder.error_body(status, body), status_code=status, headers=headers)

    async def _stream(
        self, first: pb.GenerateResponse, responses: AsyncIterator[pb.GenerateResponse], send: Send
    ) -> None:
        headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]
        headers += [(k.encode(), v.encode()) for k, v in self.headers_.items()]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        for opening in self.builder.first_chunks():
            await self._send_event(send, opening)
        try:
            # Read to the generator's end (not only to the finish reason) so the request ends as completed.
            async for response in _prepend(first, responses):
                for event in self.builder.events(response):
                    await self._send_event(send, event)
        except ServiceError as exc:
            # The status is sent: an error after it is reported as an event, the way OpenAI's streams do.
            status, body = service_error_json(exc, self.builder.parsed.field_names)
            await self._send_event(send, self.builder.error_event(status, body))
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        for event in self.builder.last_events():
            await self._send_event(send, event)
        await send({"type": "http.response.body", "body": self.builder.STREAM_END, "more_body": False})

    async def _send_event(self, send: Send, event: dict[str, Any]) -> None:
        await send({"type": "http.response.body", "body": self.builder.sse(event), "more_body": True})


def _string_field(body: Any, name: str) -> str:
    value = body.get(name) if isinstance(body, dict) else None
    if not isinstance(value, str) or not value:
        raise BadRequest(f"'{name}' is required: a non-empty string", name, "missing_required_parameter")
    return value


async def _prepend(first: T, rest: AsyncIterator[T]) -> AsyncIterator[T]:
    yield first
    async for item in rest:
        yield item


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
            parsed: ParsedRequest = dialect.parse(await self._json_body(request, dialect))
        except (ServiceError, ValueError, RecursionError) as exc:
            status, body = refusal_json(exc)
            headers = {"www-authenticate": "Bearer"} if status == 401 else None
            return JSONResponse(dialect.builder.error_body(status, body), status_code=status, headers=headers)
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
            parsed = parse_embeddings(await self._json_body(request))
            return JSONResponse(await create_embeddings(self.service, parsed, self._adapter(parsed.model)))
        except ServiceError as exc:
            return service_error_response(exc)
        except BadRequest as exc:
            return bad_request(exc)

    async def count_tokens(self, request: Request) -> Response:
        """Anthropic's: the tokens of the prompt /v1/messages makes of the body (tools included)."""
        names: dict[str, str] = {}
        try:
            parsed = parse_messages(await self._json_body(request, MESSAGES), count_only=True)
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
        headers = {"www-authenticate": "Bearer"} if status == 401 else None
        return JSONResponse(anthropic_error(status, body), status_code=status, headers=headers)

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
        try:
            self.service.authorize(request.headers.get("authorization"), AUTH_WHERE)
        except ServiceError as exc:
            return service_error_response(exc)
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
        except ServiceError as exc:
            return service_error_response(exc)
        except BadRequest as exc:
            return bad_request(exc)
        return Response(f"Success: LoRA adapter '{name}' added successfully.", media_type="text/plain")

    async def unload_lora_adapter(self, request: Request) -> Response:
        """vLLM's shape: {"lora_name": ...}; refused (409) while requests use it."""
        try:
            name = _string_field(await self._json_body(request), "lora_name")
            await self.service.unload_adapter(name, request.headers.get("authorization"), AUTH_WHERE)
        except ServiceError as exc:
            return service_error_response(exc)
        except BadRequest as exc:
            return bad_request(exc)
        return Response(f"Success: LoRA adapter '{name}' removed successfully.", media_type="text/plain")

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
        self.service.authorize(*self._authorization(request, dialect))
        body = await read_body(request, self.service.settings.request_bytes_limit)
        try:
            return json.loads(body or b"null")
        except json.JSONDecodeError as exc:
            raise BadRequest(f"the body is not valid JSON: {exc}", code="invalid_json") from None
        except UnicodeDecodeError as exc:  # (json.loads reads bytes as UTF-8, -16 or -32, by their first bytes)
            raise BadRequest(f"the body is not JSON in UTF-8: {exc}", code="invalid_json") from None
        except RecursionError:
            raise BadRequest("the body's JSON is nested too deeply to read", code="invalid_json") from None

    async def tokenize(self, request: Request) -> Response:
        tokenizer = self.service.tokenizer
        try:
            body = parse_tokenize(await self._json_body(request))
            if body.chat is not None:
                chat = chat_messages(body.chat, tokenizer)[0]
                ids = await asyncio.to_thread(tokenizer.encode_chat, chat, body.add_generation_prompt)
            else:
                ids = await asyncio.to_thread(tokenizer.encode, body.prompt or "")  # off the event loop
                if body.add_special_tokens and tokenizer.add_bos and tokenizer.bos_token_id is not None:
                    ids = [tokenizer.bos_token_id, *ids]
        except ServiceError as exc:
            return service_error_response(exc)
        except BadRequest as exc:
            return bad_request(exc)
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
            ids = parse_detokenize(await self._json_body(request))
            check_token_ids("tokens", ids, tokenizer.vocab_size)
        except ServiceError as exc:
            return service_error_response(exc)
        except BadRequest as exc:
            return bad_request(exc)
        except InvalidRequest as exc:
            return error_response(400, "invalid_request_error", str(exc), "tokens", exc.code)
        return JSONResponse({"prompt": tokenizer.decode(ids)})

    async def tokenizer_info(self, request: Request) -> Response:
        """What a client needs to tokenize as the server does (vLLM's route): the special tokens' text
        and the chat template. lm-evaluation-harness finds it and then sends token ids."""
        try:
            self.service.authorize(request.headers.get("authorization"), AUTH_WHERE)
        except ServiceError as exc:
            return service_error_response(exc)
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
        if not self.service.settings.metrics_without_auth:
            try:
                self.service.authorize(request.headers.get("authorization"), AUTH_WHERE)
            except ServiceError as exc:
                return service_error_response(exc)
        return Response(generate_latest(self.service.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def openapi(self, request: Request) -> Response:
        """Every route described (openapi.py), with this server's limits."""
        try:
            limits = self.service.limits()
        except ServiceError:  # still loading: the model's own bounds are not known yet
            s = self.service.settings
            limits = Limits(0, 0, s.max_new_tokens_limit, s.max_top_logprobs, s.max_stop_strings)
        return JSONResponse(openapi.document(limits, __version__))


class _ToStructlog(logging.Handler):
    """uvicorn logs through the standard library; its lines go out through structlog like ours."""

    def emit(self, record: logging.LogRecord) -> None:
        log.log(record.levelno, "uvicorn", message=record.getMessage(), exc_info=record.exc_info or None)


class _Server(uvicorn.Server):
    # The server process owns SIGTERM/SIGINT (draining); uvicorn must not take them over.
    @contextlib.contextmanager
    def capture_signals(self) -> Any:
        yield


class HttpServer:
    """uvicorn on a socket bound up front (so a taken port fails start-up like the gRPC port does)."""

    def __init__(self, api: HttpApi, host: str, port: int) -> None:
        self.sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.port = int(self.sock.getsockname()[1])
        uvicorn_log = logging.getLogger("uvicorn")
        uvicorn_log.handlers = [_ToStructlog()]
        uvicorn_log.setLevel(logging.WARNING)
        uvicorn_log.propagate = False
        config = uvicorn.Config(api.app, log_config=None, access_log=False, lifespan="off", timeout_graceful_shutdown=1)
        self.server = _Server(config)
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.task = asyncio.ensure_future(self.server.serve(sockets=[self.sock]))

    async def stop(self) -> None:
        self.server.should_exit = True
        if self.task is not None:
            await self.task
        self.sock.close()
