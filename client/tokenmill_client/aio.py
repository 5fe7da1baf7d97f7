"""The asyncio client (grpc.aio)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, TypeVar

import grpc
import grpc.aio

from . import _core
from ._chat import MessageLike
from ._connect import Connections
from ._convert import event_from_proto
from ._core import ClientBase, UnaryCall, cancel
from ._options import GenerateOptions, GenerateOverrides, resolve_options
from ._proto import generate_pb2 as pb
from ._transport import GENERATE
from ._types import GenerateEvent, GenerateResult, HealthStatus, ModelInfo, Tokenization

if TYPE_CHECKING:
    # Annotations only (never evaluated at run time): typing.Self and typing.Unpack need Python 3.11.
    from typing_extensions import Self, Unpack

_T = TypeVar("_T")
_Req = TypeVar("_Req")
_Resp = TypeVar("_Resp")


class AsyncClient(ClientBase):
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

    def _connect(self) -> None:
        self._channel = self._core.open(self._core.settings.aio_channel)
        self._generate = GENERATE.aio_stream(self._channel)

    async def wait_for_addresses(self, timeout: float) -> Connections:
        """Connects, and waits up to ``timeout`` seconds until the channel is ready: with round_robin, until
        it is connected to every address the target resolves to (see Client.wait_for_addresses)."""
        return await self._core.watch.wait_async(self._channel, timeout, every_address=self._core.every_address)

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
        request, timeout = self._core.generate_request(prompt, messages, token_ids, options, overrides)
        return self._stream(request, timeout)

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
        collector = self._core.text(options, overrides)
        async for event in self.generate(prompt, messages=messages, token_ids=token_ids, options=collector.options):
            collector.add(event)
        return collector.result()

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
        collector = self._core.choices(options, overrides)
        async for event in self.generate(prompt, messages=messages, token_ids=token_ids, options=collector.options):
            collector.add(event)
        return collector.result()

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
        return await self._unary(_core.tokenize_call(text_or_messages), timeout)

    async def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        """The loaded model, the server's limits and its engines' state."""
        return await self._unary(_core.model_info_call(), timeout)

    async def load_lora_adapter(self, name: str, path: str, *, timeout: float | None = None) -> None:
        """Serve the LoRA adapter at ``path`` (a PEFT directory on the server's disk) as ``name``, on every
        worker; InvalidArgumentError names what does not fit the base model."""
        await self._unary(_core.load_adapter_call(name, path), timeout)

    async def unload_lora_adapter(self, name: str, *, timeout: float | None = None) -> None:
        """Stop serving the LoRA adapter ``name``; refused while requests use it (nothing is broken)."""
        await self._unary(_core.unload_adapter_call(name), timeout)

    async def health(self, service: str = "", *, timeout: float | None = None) -> HealthStatus:
        """The grpc.health.v1 status of ``service`` ("" = the whole server)."""
        return await self._unary(_core.health_call(service), timeout)

    async def _unary(self, call: UnaryCall[_Req, _Resp, _T], timeout: float | None) -> _T:
        method = call.method.aio_unary(self._channel)
        attempts = self._core.attempts(timeout)
        while True:
            try:
                response = await method(call.request, timeout=attempts.timeout(), metadata=attempts.metadata)
            except grpc.RpcError as err:
                await asyncio.sleep(attempts.delay(err))
            else:
                return call.parse(response)

    async def _stream(self, request: pb.GenerateRequest, timeout: float | None) -> AsyncGenerator[GenerateEvent, None]:
        attempts = self._core.attempts(timeout)
        while True:
            call = self._generate(request, timeout=attempts.timeout(), metadata=attempts.metadata)
            received = False
            try:
                async for response in call:
                    received = True
                    yield event_from_proto(response)
                return
            except grpc.RpcError as err:
                # Once a response has arrived a retry would repeat it: only a call that sent nothing is retried.
                await asyncio.sleep(attempts.delay(err, retryable=not received))
            finally:
                # A no-op once the call has finished; otherwise the caller walked away: stop the server.
                cancel(call)
