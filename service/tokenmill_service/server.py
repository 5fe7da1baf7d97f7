"""The gRPC servicer: request -> validated engine request -> router; token events -> responses.

Errors always end the call with a status code and a message; they never arrive inside a
successful message. Every log line of a request carries its request_id.
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
import structlog

from tokenmill_service.config import Settings
from tokenmill_service.engine.request import MIN_TEMPERATURE, FinishReason, TokenOutput
from tokenmill_service.metrics import Metrics
from tokenmill_service.proto import pb, pb_grpc
from tokenmill_service.router import DeadlineExceeded, Overloaded, Rejected, Router, Unavailable
from tokenmill_service.tokenizer import Tokenizer
from tokenmill_service.validation import (
    MAX_REQUEST_ID_LENGTH,
    MAX_STOP_STRING_LENGTH,
    MAX_STOP_TOKEN_IDS,
    InvalidRequest,
    Limits,
    build_request,
    check_request_id,
    prompt_ids,
)

log = structlog.get_logger("tokenmill.server")

FINISH_REASONS = {
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.EOS: pb.FINISH_REASON_EOS,
    FinishReason.STOP_SEQUENCE: pb.FINISH_REASON_STOP_SEQUENCE,
    FinishReason.CONTEXT_LIMIT: pb.FINISH_REASON_CONTEXT_LIMIT,
}


class CallError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def token_proto(t: TokenOutput) -> pb.Token:
    tok = pb.Token(id=t.id, text=t.text, special=t.special)
    if t.logprob is not None:
        tok.logprob = t.logprob
    for alt in t.top_logprobs:
        tok.top_logprobs.add(id=alt.id, text=alt.text, logprob=alt.logprob)
    return tok


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, settings: Settings, router: Router, tokenizer: Tokenizer, metrics: Metrics) -> None:
        self.settings = settings
        self.router = router
        self.tokenizer = tokenizer
        self.metrics = metrics
        # Compared in constant time, each of them, so the time taken tells nothing about any token.
        self._tokens = [f"Bearer {t}".encode() for t in settings.auth_tokens()]

    # -- helpers ------------------------------------------------------------------------------

    def limits(self) -> Limits:
        info = next((w.info for w in self.router.workers if w.info is not None), None)
        if info is None:
            raise CallError(grpc.StatusCode.UNAVAILABLE, "the model is still loading; retry shortly")
        s = self.settings
        return Limits(
            context_length=info.context_length,
            vocab_size=info.vocab_size,
            max_new_tokens=s.max_new_tokens_limit,
            max_top_logprobs=s.max_top_logprobs,
            max_stop_strings=s.max_stop_strings,
        )

    def _authorize(self, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        if not self._tokens:
            return
        metadata = dict(context.invocation_metadata() or ())
        given = str(metadata.get("authorization", "")).encode()
        matched = False
        for token in self._tokens:
            matched |= hmac.compare_digest(given, token)
        if not matched:
            raise CallError(
                grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token in 'authorization' metadata"
            )

    @staticmethod
    def _request_id(request: pb.GenerateRequest, context: grpc.aio.ServicerContext[Any, Any]) -> str:
        if request.request_id:
            return request.request_id
        for key, value in context.invocation_metadata() or ():
            if key == "x-request-id" and value:
                return str(value)
        return uuid.uuid4().hex

    # -- RPCs ---------------------------------------------------------------------------------

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.GenerateResponse]:
        arrival = time.monotonic()
        request_id = self._request_id(request, context)
        structlog.contextvars.bind_contextvars(request_id=request_id[:MAX_REQUEST_ID_LENGTH])
        code = grpc.StatusCode.OK
        prompt_len = completion_len = 0
        first_token_at: float | None = None
        finish: FinishReason | None = None
        error = ""
        try:
            try:
                self._authorize(context)
                if not request.request_id:
                    check_request_id(request_id, "the x-request-id metadata")
                if self.router.draining:
                    raise Unavailable("the server is shutting down; retry on another replica")
                engine_request = build_request(request, self.tokenizer, self.limits())
            except InvalidRequest as exc:
                raise CallError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
            prompt_len = len(engine_request.prompt_ids)
            stream = self.router.submit(engine_request)
            structlog.contextvars.bind_contextvars(worker_id=stream.worker_id)
            last_at = arrival
            queue_s = 0.0
            remaining = context.time_remaining()
            if remaining is not None:
                # One timer for the whole call (not a task per message): it ends the stream with an error.
                stream.expire_after(remaining)
            try:
                async for out in stream:
                    now = time.monotonic()
                    if out.queue_s is not None:
                        queue_s = out.queue_s
                    if out.tokens:
                        if first_token_at is None:
                            first_token_at = now
                            self.metrics.time_to_first_token.observe(now - arrival)
                            self.metrics.queue_time.observe(queue_s)
                        else:
                            per_token = (now - last_at) / len(out.tokens)
                            for _ in out.tokens:
                                self.metrics.inter_token_latency.observe(per_token)
                        last_at = now
                    completion_len = out.completion_len or completion_len
                    response = pb.GenerateResponse(
                        request_id=request_id, text=out.text, tokens=[token_proto(t) for t in out.tokens]
                    )
                    if out.prompt_tokens:
                        response.prompt_tokens.extend(token_proto(t) for t in out.prompt_tokens)
                    if out.finish_reason is not None:
                        finish = out.finish_reason
                        response.finish_reason = FINISH_REASONS[out.finish_reason]
                        response.usage.prompt_tokens = prompt_len
                        response.usage.completion_tokens = completion_len
                        response.timing.queue_ms = queue_s * 1000
                        response.timing.time_to_first_token_ms = ((first_token_at or now) - arrival) * 1000
                        response.timing.total_ms = (now - arrival) * 1000
                    yield response
            finally:
                stream.close()
        except CallError as exc:
            code, error = exc.code, exc.message
        except DeadlineExceeded as exc:
            code, error = grpc.StatusCode.DEADLINE_EXCEEDED, str(exc)
        except Rejected as exc:
            code, error = grpc.StatusCode.INVALID_ARGUMENT, str(exc)
        except Overloaded as exc:
            code, error = grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
        except Unavailable as exc:
            code, error = grpc.StatusCode.UNAVAILABLE, str(exc)
        except asyncio.CancelledError:
            code, error = grpc.StatusCode.CANCELLED, "the caller cancelled"
            raise
        finally:
            self._finished(code, error, prompt_len, completion_len, first_token_at, arrival, finish)
        if code is not grpc.StatusCode.OK:
            await context.abort(code, error)

    def _finished(
        self,
        code: grpc.StatusCode,
        error: str,
        prompt_len: int,
        completion_len: int,
        first_token_at: float | None,
        arrival: float,
        finish: FinishReason | None,
    ) -> None:
        duration = time.monotonic() - arrival
        self.metrics.requests.labels(code=code.name).inc()
        self.metrics.request_duration.observe(duration)
        self.metrics.prompt_tokens.inc(prompt_len)
        self.metrics.generated_tokens.inc(completion_len)
        fields: dict[str, Any] = {
            "status": code.name,
            "prompt_tokens": prompt_len,
            "completion_tokens": completion_len,
            "duration_ms": round(duration * 1000, 1),
        }
        if first_token_at is not None:
            fields["ttft_ms"] = round((first_token_at - arrival) * 1000, 1)
        if finish is not None:
            fields["finish_reason"] = finish.value
        if error:
            fields["error"] = error
        log.info("request_finished", **fields)
        structlog.contextvars.unbind_contextvars("request_id", "worker_id")

    async def Tokenize(
        self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.TokenizeResponse:
        try:
            self._authorize(context)
            ids = prompt_ids(request, self.tokenizer, self.tokenizer.vocab_size)
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except CallError as exc:
            await context.abort(exc.code, exc.message)
        return pb.TokenizeResponse(ids=ids, pieces=[self.tokenizer.token_text(i) for i in ids])

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ModelInfo:
        try:
            self._authorize(context)
        except CallError as exc:
            await context.abort(exc.code, exc.message)
        s = self.settings
        info = next((w.info for w in self.router.workers if w.info is not None), None)
        reply = pb.ModelInfo(
            backend=s.backend,
            num_workers=len(self.router.workers),
            vocab_size=self.tokenizer.vocab_size,
            limits=pb.Limits(
                max_new_tokens=s.max_new_tokens_limit,
                max_top_logprobs=s.max_top_logprobs,
                max_stop_strings=s.max_stop_strings,
                max_queue=s.max_queue,
                max_batch_size=s.max_batch_size,
                max_request_id_length=MAX_REQUEST_ID_LENGTH,
                min_temperature=MIN_TEMPERATURE,
                max_stop_string_length=MAX_STOP_STRING_LENGTH,
                max_stop_token_ids=MAX_STOP_TOKEN_IDS,
                max_resumptions=s.max_resumptions,
            ),
        )
        if info is not None:
            reply.name, reply.context_length, reply.device = info.model_name, info.context_length, info.device
            reply.dtype = info.dtype
        for w in self.router.workers:
            state = reply.workers.add(worker_id=w.worker_id, alive=w.serving, restarts=w.restarts)
            if w.stats is not None and w.serving:
                state.running, state.waiting = w.stats.running, w.stats.waiting
                state.kv_blocks_used, state.kv_blocks_total = w.stats.kv_blocks_used, w.stats.kv_blocks_total
                state.kv_block_size = w.stats.kv_block_size
            elif w.info is not None:
                state.kv_blocks_total, state.kv_block_size = w.info.kv_blocks_total, w.info.kv_block_size
            for name in ("running", "waiting", "kv_blocks_used", "kv_blocks_total"):
                setattr(reply.engine, name, getattr(reply.engine, name) + getattr(state, name))
            reply.engine.kv_block_size = state.kv_block_size or reply.engine.kv_block_size
        return reply


def engine_totals(router: Router) -> dict[str, int]:
    totals = {"running": 0, "waiting": 0, "kv_blocks_used": 0, "kv_blocks_total": 0, "serving": 0}
    for w in router.workers:
        if w.serving:
            totals["serving"] += 1
            if w.stats is not None:
                totals["running"] += w.stats.running
                totals["waiting"] += w.stats.waiting
                totals["kv_blocks_used"] += w.stats.kv_blocks_used
                totals["kv_blocks_total"] += w.stats.kv_blocks_total
            elif w.info is not None:
                totals["kv_blocks_total"] += w.info.kv_blocks_total
    return totals


def parsing(message: type[Any], handler: Any) -> Any:
    """Wrap an RPC method so it takes the raw request bytes: bytes that do not parse end the call with
    INVALID_ARGUMENT (grpc's own deserializer would answer UNKNOWN with a Python exception name)."""
    name = message.DESCRIPTOR.full_name

    def parse(raw: bytes) -> Any:
        try:
            return message.FromString(raw)
        except Exception as exc:  # noqa: BLE001 - DecodeError and whatever else the parser raises
            raise CallError(grpc.StatusCode.INVALID_ARGUMENT, f"the request is not a valid {name}: {exc}") from None

    if inspect.isasyncgenfunction(handler):

        async def stream(raw: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
            try:
                request = parse(raw)
            except CallError as exc:
                await context.abort(exc.code, exc.message)
            async for response in handler(request, context):
                yield response

        return stream

    async def unary(raw: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        try:
            request = parse(raw)
        except CallError as exc:
            await context.abort(exc.code, exc.message)
        return await handler(request, context)

    return unary


def add_generation_servicer(servicer: GenerationServicer, server: grpc.aio.Server) -> None:
    """Register the Generation service with request parsing done by `parsing` (see there)."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            parsing(pb.GenerateRequest, servicer.Generate),
            response_serializer=pb.GenerateResponse.SerializeToString,
        ),
        "Tokenize": grpc.unary_unary_rpc_method_handler(
            parsing(pb.TokenizeRequest, servicer.Tokenize),
            response_serializer=pb.TokenizeResponse.SerializeToString,
        ),
        "GetModelInfo": grpc.unary_unary_rpc_method_handler(
            parsing(pb.GetModelInfoRequest, servicer.GetModelInfo),
            response_serializer=pb.ModelInfo.SerializeToString,
        ),
    }
    service = pb.DESCRIPTOR.services_by_name["Generation"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
