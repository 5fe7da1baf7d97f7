"""The gRPC servicer: gRPC calls in, GenerationService (generation.py) does the work.

Errors always end the call with a status code and a message; they never arrive inside a
successful message. Every log line of a request carries its request_id.
"""

from __future__ import annotations

import asyncio
import inspect
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
import structlog

from tokenmill_service.contract.config import Settings
from tokenmill_service.contract.grammar import COMPILE_TIMEOUT_S, MAX_CONSTRAINT_LENGTH
from tokenmill_service.contract.request import MIN_TEMPERATURE
from tokenmill_service.contract.tokenizer import Tokenizer
from tokenmill_service.front.generation import GenerationService, ServiceError
from tokenmill_service.front.metrics import Metrics
from tokenmill_service.front.proto import pb, pb_grpc
from tokenmill_service.front.router import Router
from tokenmill_service.front.validation import (
    MAX_CHOICES,
    MAX_LOGIT_BIAS,
    MAX_REQUEST_ID_LENGTH,
    MAX_STOP_STRING_LENGTH,
    MAX_STOP_TOKEN_IDS,
    InvalidRequest,
    prompt_ids,
)

log = structlog.get_logger("tokenmill.server")

AUTH_WHERE = "'authorization' metadata"


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, settings: Settings, router: Router, tokenizer: Tokenizer, metrics: Metrics) -> None:
        self.settings = settings
        self.router = router
        self.tokenizer = tokenizer
        self.metrics = metrics
        # The rules every Generate call follows; the HTTP front-end shares this same object.
        self.service = GenerationService(settings, router, tokenizer, metrics)

    # -- helpers ------------------------------------------------------------------------------

    @staticmethod
    def _authorization(context: grpc.aio.ServicerContext[Any, Any]) -> str | None:
        return dict(context.invocation_metadata() or ()).get("authorization")

    def _authorize(self, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        self.service.authorize(self._authorization(context), AUTH_WHERE)

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
        error: ServiceError | None = None
        try:
            responses = self.service.generate(
                request,
                self._request_id(request, context),
                self._authorization(context),
                AUTH_WHERE,
                context.time_remaining(),
            )
            async for response in responses:
                yield response
        except ServiceError as exc:
            error = exc
        # Abort outside the generator's try: the call was already counted and logged.
        if error is not None:
            await context.abort(error.code, error.message)

    async def Tokenize(
        self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.TokenizeResponse:
        try:
            self._authorize(context)
            ids = await asyncio.to_thread(
                prompt_ids, request, self.tokenizer, self.tokenizer.vocab_size
            )  # off the loop
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except ServiceError as exc:
            await context.abort(exc.code, exc.message)
        return pb.TokenizeResponse(ids=ids, pieces=[self.tokenizer.token_text(i) for i in ids])

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ModelInfo:
        try:
            self._authorize(context)
        except ServiceError as exc:
            await context.abort(exc.code, exc.message)
        s = self.settings
        info = next((w.info for w in self.router.workers if w.info is not None), None)
        reply = pb.ModelInfo(
            backend=s.backend,
            num_workers=len(self.router.workers),
            tensor_parallel=s.tensor_parallel,
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
                max_logit_bias=MAX_LOGIT_BIAS,
                max_constraint_length=MAX_CONSTRAINT_LENGTH,
                constraint_compile_timeout_s=COMPILE_TIMEOUT_S,
                max_loras=s.max_loras,
                max_lora_rank=s.max_lora_rank,
                max_n=MAX_CHOICES,
            ),
        )
        for name, path in sorted(self.router.adapters.served.items()):
            reply.adapters.add(name=name, path=path)
        if info is not None:
            reply.name, reply.context_length, reply.device = self.service.model_name(), info.context_length, info.device
            reply.dtype, reply.quantization, reply.weight_bytes = info.dtype, info.quantization, info.weight_bytes
            reply.load_plan.update(info.plan)
            reply.kv_cache_per_sequence = info.kv_per_sequence
        for w in self.router.workers:
            state = reply.workers.add(worker_id=w.worker_id, alive=w.serving, restarts=w.restarts)
            for rank, (proc, device) in enumerate(zip(w.processes, w.devices)):
                state.ranks.add(rank=rank, pid=proc.pid or 0, device=device)
            if w.stats is not None and w.serving:
                state.running, state.waiting = w.stats.running, w.stats.waiting
                state.kv_blocks_used, state.kv_blocks_total = w.stats.kv_blocks_used, w.stats.kv_blocks_total
                state.kv_block_size = w.stats.kv_block_size
            elif w.info is not None:
                state.kv_blocks_total, state.kv_block_size = w.info.kv_blocks_total, w.info.kv_block_size
            for name in ("running", "waiting", "kv_blocks_used", "kv_blocks_total"):
                setattr(reply.engine, name, getattr(reply.engine, name) + getattr(state, name))
            if w.stats is not None and w.serving:
                reply.engine.draft_tokens_proposed += w.stats.draft_tokens_proposed
                reply.engine.draft_tokens_accepted += w.stats.draft_tokens_accepted
            reply.engine.kv_block_size = state.kv_block_size or reply.engine.kv_block_size
        return reply

    async def LoadLoRAAdapter(
        self, request: pb.LoadLoRAAdapterRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.LoadLoRAAdapterResponse:
        try:
            await self.service.load_adapter(
                request.lora_name, request.lora_path, self._authorization(context), AUTH_WHERE
            )
        except ServiceError as exc:
            await context.abort(exc.code, exc.message)
        return pb.LoadLoRAAdapterResponse()

    async def UnloadLoRAAdapter(
        self, request: pb.UnloadLoRAAdapterRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.UnloadLoRAAdapterResponse:
        try:
            await self.service.unload_adapter(request.lora_name, self._authorization(context), AUTH_WHERE)
        except ServiceError as exc:
            await context.abort(exc.code, exc.message)
        return pb.UnloadLoRAAdapterResponse()


def adapter_state(router: Router, max_loras: int) -> tuple[list[str], list[str], int, int]:
    """The adapters of the running and the waiting requests (all workers), the slots, the adapters loaded."""
    running: set[str] = set()
    waiting: set[str] = set()
    for w in router.workers:
        if w.serving and w.stats is not None:
            running.update(w.stats.running_adapters)
            waiting.update(w.stats.waiting_adapters)
    return sorted(running), sorted(waiting), max_loras, len(router.adapters.served)


def engine_totals(router: Router) -> dict[str, int]:
    totals = {"running": 0, "waiting": 0, "kv_blocks_used": 0, "kv_blocks_total": 0, "serving": 0}
    totals |= {"prefix_cache_queries": 0, "prefix_cache_hits": 0, "compiled_graphs": 0}
    totals |= {"draft_tokens_proposed": 0, "draft_tokens_accepted": 0}
    for w in router.workers:
        if w.serving:
            totals["serving"] += 1
            if w.stats is not None:
                totals["running"] += w.stats.running
                totals["waiting"] += w.stats.waiting
                totals["kv_blocks_used"] += w.stats.kv_blocks_used
                totals["kv_blocks_total"] += w.stats.kv_blocks_total
                totals["prefix_cache_queries"] += w.stats.prefix_cache_queries
                totals["prefix_cache_hits"] += w.stats.prefix_cache_hits
                totals["compiled_graphs"] += w.stats.compiled_graphs
                totals["draft_tokens_proposed"] += w.stats.draft_tokens_proposed
                totals["draft_tokens_accepted"] += w.stats.draft_tokens_accepted
            elif w.info is not None:
                totals["kv_blocks_total"] += w.info.kv_blocks_total
                totals["compiled_graphs"] += w.info.compiled_graphs
    return totals


def parsing(message: type[Any], handler: Any) -> Any:
    """Wrap an RPC method so it takes the raw request bytes: bytes that do not parse end the call with
    INVALID_ARGUMENT (grpc's own deserializer would answer UNKNOWN with a Python exception name)."""
    name = message.DESCRIPTOR.full_name

    def parse(raw: bytes) -> Any:
        try:
            return message.FromString(raw)
        except Exception as exc:  # noqa: BLE001 - DecodeError and whatever else the parser raises
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, f"the request is not a valid {name}: {exc}") from None

    if inspect.isasyncgenfunction(handler):

        async def stream(raw: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
            try:
                request = parse(raw)
            except ServiceError as exc:
                await context.abort(exc.code, exc.message)
            async for response in handler(request, context):
                yield response

        return stream

    async def unary(raw: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        try:
            request = parse(raw)
        except ServiceError as exc:
            await context.abort(exc.code, exc.message)
        return await handler(request, context)

    return unary


def add_generation_servicer(servicer: GenerationServicer, server: grpc.aio.Server) -> None:
    """Register the Generation service with request parsing done by `parsing` (see there)."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            parsing(pb.GenerateRequest, servicer.Generate),
            response_serializer=pb.GenerateResponse.SerializeToString,
        )
    }
    # The unary methods: each one's request and answer.
    unary: dict[str, tuple[type[Any], Any, type[Any]]] = {
        "Tokenize": (pb.TokenizeRequest, servicer.Tokenize, pb.TokenizeResponse),
        "GetModelInfo": (pb.GetModelInfoRequest, servicer.GetModelInfo, pb.ModelInfo),
        "LoadLoRAAdapter": (pb.LoadLoRAAdapterRequest, servicer.LoadLoRAAdapter, pb.LoadLoRAAdapterResponse),
        "UnloadLoRAAdapter": (pb.UnloadLoRAAdapterRequest, servicer.UnloadLoRAAdapter, pb.UnloadLoRAAdapterResponse),
    }
    for name, (request, method, response) in unary.items():
        handlers[name] = grpc.unary_unary_rpc_method_handler(
            parsing(request, method), response_serializer=response.SerializeToString
        )
    service = pb.DESCRIPTOR.services_by_name["Generation"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
