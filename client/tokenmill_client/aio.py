"""The asyncio client (grpc.aio)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncGenerator, Callable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, TypeVar, cast

import grpc
import grpc.aio

from ._connect import ChannelWatch, Connections
from ._convert import (
    ChoicesBuilder,
    ResultBuilder,
    build_generate_request,
    build_tokenize_request,
    event_from_proto,
    model_info_from_proto,
    tokenization_from_proto,
)
from ._proto import generate_pb2 as pb
from ._transport import (
    AsyncStubs,
    ChannelOptions,
    Deadline,
    RetryHook,
    Settings,
    decode_health_response,
    encode_health_request,
    make_settings,
    retry_delay,
)
from ._types import (
    GenerateEvent,
    GenerateOptions,
    GenerateOverrides,
    GenerateResult,
    HealthStatus,
    MessageLike,
    ModelInfo,
    Tokenization,
    resolve_options,
)
from .errors import TokenmillError, error_from_rpc

if TYPE_CHECKING:
    # Annotations only (never evaluated at run time): typing.Self and typing.Unpack need Python 3.11.
    from typing_extensions import Self, Unpack

_T = TypeVar("_T")
_Req = TypeVar("_Req")


class AsyncClient:
    """An asyncio client of a tokenmill server; the same options and methods as Client, awaitable.

    Create it inside the event loop that uses it (``async with AsyncClient(...) as client:``).

    ``target`` defaults to $TOKENMILL_SERVER, else ``localhost:50051``. ``tls=True`` (implied by
    ``root_certificates``, PEM bytes or a file path) uses TLS; ``token`` is sent as
    ``authorization: Bearer <token>``; ``timeout`` is the default deadline of each call in seconds
    (None = none). UNAVAILABLE is retried up to ``max_retries`` times with exponential backoff, for
    generate only while no response has arrived yet; ``on_retry(retry, delay_seconds)`` is called before each
    retry's wait. ``load_balancing="round_robin"`` spreads calls over every address ``target`` resolves to
    (``dns:///tokenmill-headless.ns.svc:50051``: a headless Service's pods; ``ipv4:10.0.0.1:50051,10.0.0.2:50051``),
    where gRPC's default (``pick_first``) sends them all down one connection; ``await wait_for_addresses(SECONDS)``
    before the first calls spreads those too. Thread-safe; use it as a context manager or call close().

    The default, 3 retries (about 1.4 s), lets a program learn soon that no server is there; the CLI,
    often started beside a server that is still loading, waits longer (``--max-retries 20``, about
    35 s): pass ``max_retries=20`` to wait as it does.
    """

    def __init__(
        self,
        target: str | None = None,
        *,
        tls: bool = False,
        root_certificates: bytes | str | os.PathLike[str] | None = None,
        token: str | None = None,
        timeout: float | None = None,
        max_retries: int = 3,
        options: ChannelOptions = (),
        on_retry: RetryHook | None = None,
        load_balancing: str | None = None,
    ) -> None:
        self._settings: Settings = make_settings(
            target,
            tls=tls,
            root_certificates=root_certificates,
            token=token,
            timeout=timeout,
            max_retries=max_retries,
            options=options,
            on_retry=on_retry,
            load_balancing=load_balancing,
        )
        self._watch = ChannelWatch(self._settings.target)
        self._channel = self._settings.aio_channel()
        self._watch.found()
        self._stubs = AsyncStubs(self._channel)

    async def wait_for_addresses(self, timeout: float) -> Connections:
        """Connects, and waits up to ``timeout`` seconds until the channel is ready: with round_robin, until
        it is connected to every address the target resolves to (see Client.wait_for_addresses)."""
        every = self._settings.load_balancing == "round_robin"
        return await self._watch.wait_async(self._channel, timeout, every_address=every)

    @property
    def target(self) -> str:
        """The server address."""
        return self._settings.target

    async def close(self) -> None:
        """Closes the channel; calls in flight are cancelled."""
        await self._channel.close(None)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    def generate(
        self,
        prompt: str | None = None,
        *,
        messages: Sequence[MessageLike] | None = None,
        token_ids: Sequence[int] | None = None,
        options: GenerateOptions | None = None,
        **overrides: Unpack[GenerateOverrides],
    ) -> AsyncGenerator[GenerateEvent, None]:
        """Streams a generation as GenerateEvents; the last one carries finish_reason, usage and timing.

        Give exactly one of ``prompt`` (raw text), ``messages`` (a chat, rendered with the model's
        template) or ``token_ids``. How to generate is ``options`` (a GenerateOptions), with any of its
        fields given as keywords overriding it (``max_new_tokens=64``). Use it with ``async for``; the
        call starts on the first step. Stopping early (``aclose()``, an exception, task cancellation, or
        ``break`` once the generator is collected) cancels it, so the server stops generating;
        ``contextlib.aclosing`` makes a ``break`` take effect at once.
        """
        resolved = resolve_options("generate", options, overrides)
        request = build_generate_request(prompt, messages, token_ids, resolved)
        return self._stream(request, resolved.timeout)

    async def generate_text(
        self,
        prompt: str | None = None,
        *,
        messages: Sequence[MessageLike] | None = None,
        token_ids: Sequence[int] | None = None,
        options: GenerateOptions | None = None,
        **overrides: Unpack[GenerateOverrides],
    ) -> GenerateResult:
        """Generates to the end and returns the whole result (see generate() for the parameters).
        One choice only: generate_choices() returns the n of a request with n > 1."""
        resolved = resolve_options("generate_text", options, overrides)
        if resolved.n > 1:
            raise ValueError(f"generate_text returns one result; use generate_choices for n={resolved.n}")
        builder = ResultBuilder()
        async for event in self.generate(prompt, messages=messages, token_ids=token_ids, options=resolved):
            builder.add(event)
        result = builder.result()
        if result is None:
            raise TokenmillError(
                "the server ended the stream without a finish reason", grpc.StatusCode.UNKNOWN, target=self.target
            )
        return result

    async def generate_choices(
        self,
        prompt: str | None = None,
        *,
        messages: Sequence[MessageLike] | None = None,
        token_ids: Sequence[int] | None = None,
        options: GenerateOptions | None = None,
        **overrides: Unpack[GenerateOverrides],
    ) -> tuple[GenerateResult, ...]:
        """Generates ``n`` choices of one prompt (``n=3``; see generate() for the parameters) and returns
        each one's whole result, in choice order. The prompt is computed once for all of them; each has
        its own random stream (choice 0 the seed's, choice i one derived from (seed, i))."""
        resolved = resolve_options("generate_choices", options, overrides)
        builder = ChoicesBuilder(resolved.n)
        async for event in self.generate(prompt, messages=messages, token_ids=token_ids, options=resolved):
            builder.add(event)
        results = builder.results()
        if results is None:
            raise TokenmillError(
                "the server ended the stream without a finish reason", grpc.StatusCode.UNKNOWN, target=self.target
            )
        return results

    async def chat(
        self,
        messages: Sequence[MessageLike],
        *,
        options: GenerateOptions | None = None,
        **overrides: Unpack[GenerateOverrides],
    ) -> GenerateResult:
        """The assistant's whole answer to a conversation (ChatMessages, (role, content) tuples or dicts).

        ``options`` and keyword overrides as for generate(). For a streamed answer use ``generate(messages=...)``.
        """
        resolved = resolve_options("chat", options, overrides)
        return await self.generate_text(messages=messages, options=resolved)

    async def tokenize(
        self, text_or_messages: str | Sequence[MessageLike], *, timeout: float | None = None
    ) -> Tokenization:
        """Token ids and pieces of raw text, or of a chat rendered with the model's template."""
        request = build_tokenize_request(text_or_messages)
        return tokenization_from_proto(await self._unary(self._stubs.tokenize, request, timeout))

    async def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        """The loaded model, the server's limits and its engines' state."""
        return model_info_from_proto(await self._unary(self._stubs.model_info, pb.GetModelInfoRequest(), timeout))

    async def load_lora_adapter(self, name: str, path: str, *, timeout: float | None = None) -> None:
        """Serve the LoRA adapter at ``path`` (a PEFT directory on the server's disk) as ``name``, on every
        worker; InvalidArgumentError names what does not fit the base model."""
        request = pb.LoadLoRAAdapterRequest(lora_name=name, lora_path=path)
        await self._unary(self._stubs.load_adapter, request, timeout)

    async def unload_lora_adapter(self, name: str, *, timeout: float | None = None) -> None:
        """Stop serving the LoRA adapter ``name``; refused while requests use it (nothing is broken)."""
        await self._unary(self._stubs.unload_adapter, pb.UnloadLoRAAdapterRequest(lora_name=name), timeout)

    async def health(self, service: str = "", *, timeout: float | None = None) -> HealthStatus:
        """The grpc.health.v1 status of ``service`` ("" = the whole server)."""
        return decode_health_response(await self._unary(self._stubs.health, encode_health_request(service), timeout))

    def _timeout(self, timeout: float | None) -> float | None:
        return self._settings.timeout if timeout is None else timeout

    async def _unary(
        self, method: grpc.aio.UnaryUnaryMultiCallable[_Req, _T], request: _Req, timeout: float | None
    ) -> _T:
        settings = self._settings
        deadline = Deadline(self._timeout(timeout))
        retry = 0
        while True:
            try:
                return await method(request, timeout=deadline.remaining(), metadata=settings.metadata)
            except grpc.RpcError as err:
                delay = retry_delay(_code(err), settings, deadline, retry)
                if delay is None:
                    raise error_from_rpc(err, settings.target) from err
                await asyncio.sleep(delay)
                retry += 1

    async def _stream(self, request: pb.GenerateRequest, timeout: float | None) -> AsyncGenerator[GenerateEvent, None]:
        settings = self._settings
        deadline = Deadline(self._timeout(timeout))
        retry = 0
        while True:
            call = self._stubs.generate(request, timeout=deadline.remaining(), metadata=settings.metadata)
            received = False
            try:
                async for response in call:
                    received = True
                    yield event_from_proto(response)
                return
            except grpc.RpcError as err:
                delay = None if received else retry_delay(_code(err), settings, deadline, retry)
                if delay is None:
                    raise error_from_rpc(err, settings.target) from err
                await asyncio.sleep(delay)
                retry += 1
            finally:
                # A no-op once the call has finished; otherwise the caller walked away: stop the server.
                _cancel(call)


def _code(err: grpc.RpcError) -> grpc.StatusCode | None:
    code = getattr(err, "code", None)
    return code() if callable(code) else None


def _cancel(call: grpc.aio.RpcContext) -> None:
    # grpc-stubs leaves cancel() unannotated.
    cast("Callable[[], object]", call.cancel)()
