"""One Generate call, whatever front-end it came through (gRPC or the OpenAI-compatible HTTP API).

Auth, draining, validation, admission, streaming the outputs as `GenerateResponse` messages,
metrics and the `request_finished` log line live here once, so both front-ends apply the same
rules. A failure ends the stream with `ServiceError` (a gRPC status code and a message) after the
request was counted and logged; each front-end only translates that code into its own protocol.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
import structlog

from tokenmill_service.contract.config import Settings
from tokenmill_service.contract.grammar import COMPILE_TIMEOUT_S, ConstraintError, GrammarCompiler
from tokenmill_service.contract.request import (
    Constraint,
    GenerationRequest,
    RequestOutput,
    choice_seed,
)
from tokenmill_service.contract.tokenizer import Tokenizer
from tokenmill_service.front.choice_responses import ChoiceResponses, RequestTally
from tokenmill_service.front.metrics import Metrics
from tokenmill_service.front.proto import pb
from tokenmill_service.front.router import AdapterNotFound, RequestStream, Router, RouterError, ShuttingDown, status_of
from tokenmill_service.front.validation import (
    CONSTRAINT_FIELDS,
    MAX_REQUEST_ID_LENGTH,
    InvalidRequest,
    Limits,
    build_request,
    check_request_id,
)

log = structlog.get_logger("tokenmill.server")


class ServiceError(Exception):
    """A call that ends with a non-OK status; `message` names the field or the cause.

    An invalid field also comes as `field` (its path in the GenerateRequest, as the message names it) and
    `reason` (the kind of problem), for a front-end that names fields its own way (see InvalidRequest)."""

    def __init__(
        self, code: grpc.StatusCode, message: str, field: str | None = None, reason: str | None = None
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.field = field
        self.reason = reason


def choice_requests(request: GenerationRequest, n: int) -> list[GenerationRequest]:
    """The engine requests of a request's n choices: one per choice, sharing a prefix group (so the
    engine computes their prompt once) and each with its own seed (choice_seed); the prompt's
    logprobs, the same for all, only with choice 0."""
    if n == 1:
        return [request]
    group = uuid.uuid4().hex
    choices = []
    for index in range(n):
        seed = request.sampling.seed
        sampling = dataclasses.replace(request.sampling, seed=None if seed is None else choice_seed(seed, index))
        choices.append(
            dataclasses.replace(
                request, sampling=sampling, prompt_logprobs=request.prompt_logprobs and index == 0, prefix_group=group
            )
        )
    return choices


async def merged(streams: Sequence[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The outputs of several streams as they come, each with its stream's index; the first error ends
    them all (the caller closes the streams)."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | RouterError | None]] = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((index, out))
        except RouterError as exc:  # handed to the reader, which raises it
            queue.put_nowait((index, exc))
            return
        queue.put_nowait((index, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, RouterError):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


def bearer_token(authorization: str | None) -> str:
    """The token of an Authorization value in the Bearer scheme, whose name is case-insensitive ("Bearer",
    "bearer": RFC 9110 section 11.1); "" for another scheme or none."""
    scheme, _, token = (authorization or "").strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


class GenerationService:
    """The front-end-independent half of the server: what every Generate call goes through."""

    def __init__(self, settings: Settings, router: Router, tokenizer: Tokenizer, metrics: Metrics) -> None:
        self.settings = settings
        self.router = router
        self.tokenizer = tokenizer
        self.metrics = metrics
        # Constraints are compiled here first, so one that cannot be used is refused before it reaches a
        # worker (which compiles it again from its own cache): the engine loop never stalls on a bad one.
        self.grammars = GrammarCompiler(tokenizer)
        # Compared in constant time, each of them, so the time taken tells nothing about any token.
        self._tokens = [t.encode() for t in settings.auth_tokens()]

    def model_name(self) -> str:
        """What callers know the model as: --served-model-name, else the checkpoint's name ("" while loading)."""
        if self.settings.served_model_name:
            return self.settings.served_model_name
        info = next((w.info for w in self.router.workers if w.info is not None), None)
        return info.model_name if info is not None else ""

    def context_length(self) -> int | None:
        """The most tokens one request may hold; None while no worker has loaded the model."""
        info = next((w.info for w in self.router.workers if w.info is not None), None)
        return info.context_length if info is not None else None

    def limits(self) -> Limits:
        info = next((w.info for w in self.router.workers if w.info is not None), None)
        if info is None:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, "the model is still loading; retry shortly")
        return Limits.from_settings(self.settings, info.context_length, info.vocab_size)

    def check_generates(self) -> None:
        """An encoder only embeds: a generation is refused (INVALID_ARGUMENT), saying so."""
        info = next((w.info for w in self.router.workers if w.info is not None), None)
        if info is not None and info.embedding is not None and not info.embedding.generates:
            raise InvalidRequest(
                f"the model {self.model_name()!r} is an encoder: it embeds only (POST /v1/embeddings) and does not "
                "generate",
                "model",
                "model_does_not_generate",
            )

    async def check_constraint(self, constraint: Constraint) -> None:
        """Compile the constraint (off the event loop; llguidance releases the GIL), or InvalidRequest naming
        the problem; a compile running past COMPILE_TIMEOUT_S is refused (it finishes in the background)."""
        await asyncio.to_thread(lambda: self.grammars.lltok)  # built once; not part of the time limit
        field_path = CONSTRAINT_FIELDS[constraint.kind]
        try:
            await asyncio.wait_for(asyncio.to_thread(self.grammars.matcher, constraint), COMPILE_TIMEOUT_S)
        except ConstraintError as exc:
            raise InvalidRequest(f"{field_path}: {exc}", field_path) from None
        except TimeoutError:
            raise InvalidRequest(
                f"{field_path}: compiling it took longer than {COMPILE_TIMEOUT_S:g} s (the server's limit); simplify it",
                field_path,
            ) from None

    def authorize(self, authorization: str | None, where: str) -> None:
        """`authorization` is the caller's 'Bearer TOKEN' value; `where` says where it belongs."""
        if not self._tokens:
            return
        given = bearer_token(authorization).encode()
        matched = False
        for token in self._tokens:
            matched |= hmac.compare_digest(given, token)
        if not matched:
            raise ServiceError(grpc.StatusCode.UNAUTHENTICATED, f"missing or wrong bearer token in {where}")

    def authorized(self, authorization: str | None) -> bool:
        """Whether an Authorization header value passes (always, when no token is set)."""
        try:
            self.authorize(authorization, "")
        except ServiceError:
            return False
        return True

    async def generate(
        self,
        request: pb.GenerateRequest,
        request_id: str,
        authorization: str | None,
        auth_where: str,
        timeout_s: float | None = None,
        api: str = "grpc",
    ) -> AsyncIterator[pb.GenerateResponse]:
        """Stream one request's responses; raises ServiceError (after logging it) when it fails.

        `api` names the front-end in the log line ("grpc" or "http")."""
        tally = RequestTally(arrival=time.monotonic())
        structlog.contextvars.bind_contextvars(request_id=request_id[:MAX_REQUEST_ID_LENGTH], api=api)
        try:
            engine_request = await self._admit(request, request_id, authorization, auth_where, api)
            tally.prompt_len = len(engine_request.prompt_ids)
            choices = ChoiceResponses(request, request_id, self.tokenizer, self.metrics, tally)
            streams = self.router.submit_group(choice_requests(engine_request, max(1, request.n)))
            structlog.contextvars.bind_contextvars(worker_id=streams[0].worker_id)
            if timeout_s is not None:
                # One timer per stream (not a task per message): it ends the stream with an error.
                for stream in streams:
                    stream.expire_after(timeout_s)
            try:
                async with contextlib.aclosing(merged(streams)) as outputs:  # type: ignore[type-var]
                    async for index, out in outputs:
                        response = choices.response(index, out, streams[index])
                        if response is None:
                            continue
                        yield response
                        if choices.all_ended:
                            break
            finally:
                for stream in streams:
                    stream.close()
        except ServiceError as exc:
            tally.code, tally.error, tally.field, tally.reason = exc.code, exc.message, exc.field, exc.reason
        except RouterError as exc:
            status = status_of(exc)
            if status is None:
                raise
            field, reason = ("adapter", "model_not_found") if isinstance(exc, AdapterNotFound) else (None, None)
            tally.code, tally.error, tally.field, tally.reason = status, str(exc), field, reason
        except (asyncio.CancelledError, GeneratorExit):
            # The caller went away (a cancelled RPC, a closed HTTP connection).
            tally.code, tally.error = grpc.StatusCode.CANCELLED, "the caller cancelled"
            raise
        finally:
            self._finished(tally)
        if tally.code is not grpc.StatusCode.OK:
            raise ServiceError(tally.code, tally.error, tally.field, tally.reason)

    async def _admit(
        self, request: pb.GenerateRequest, request_id: str, authorization: str | None, auth_where: str, api: str
    ) -> GenerationRequest:
        """The engine request of a call its caller may make, the server takes now and validation passes
        (ServiceError otherwise)."""
        try:
            self.authorize(authorization, auth_where)
            if not request.request_id:
                check_request_id(
                    request_id, "the x-request-id header" if api == "http" else "the x-request-id metadata"
                )
            if self.router.draining:
                raise ShuttingDown()
            self.check_generates()
            # Tokenizing and rendering a chat take time in proportion to the prompt (a second or more for
            # megabytes): in a thread, so that the event loop goes on serving every other call, health
            # checks and the workers' heartbeats meanwhile.
            engine_request = await asyncio.to_thread(build_request, request, self.tokenizer, self.limits())
            if engine_request.constraint is not None:
                await self.check_constraint(engine_request.constraint)
        except InvalidRequest as exc:
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, str(exc), exc.field, exc.code) from None
        return engine_request

    async def load_adapter(self, name: str, path: str, authorization: str | None, where: str) -> None:
        """Serve the LoRA adapter at ``path`` as ``name`` on every worker (ServiceError when not)."""
        self.authorize(authorization, where)
        await _adapter_call(self.router.adapters.load(name, path))

    async def unload_adapter(self, name: str, authorization: str | None, where: str) -> None:
        self.authorize(authorization, where)
        await _adapter_call(self.router.adapters.unload(name))

    def _finished(self, tally: RequestTally) -> None:
        duration = time.monotonic() - tally.arrival
        self.metrics.requests.labels(code=tally.code.name).inc()
        self.metrics.request_duration.observe(duration)
        self.metrics.prompt_tokens.inc(tally.prompt_len)
        self.metrics.generated_tokens.inc(tally.completion_len)
        fields: dict[str, Any] = {
            "status": tally.code.name,
            "prompt_tokens": tally.prompt_len,
            "completion_tokens": tally.completion_len,
            "duration_ms": round(duration * 1000, 1),
        }
        if tally.first_token_at is not None:
            fields["ttft_ms"] = round((tally.first_token_at - tally.arrival) * 1000, 1)
        if tally.finish is not None:
            fields["finish_reason"] = tally.finish.value
        if tally.error:
            fields["error"] = tally.error
        log.info("request_finished", **fields)
        structlog.contextvars.unbind_contextvars("request_id", "worker_id", "api")


async def _adapter_call(call: Any) -> None:
    try:
        await call
    except RouterError as exc:
        code = status_of(exc) or grpc.StatusCode.INTERNAL
        raise ServiceError(code, str(exc), "lora_name" if code is not grpc.StatusCode.UNAVAILABLE else None) from None
