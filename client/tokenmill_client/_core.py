"""What Client and AsyncClient share: their constructor, settings and channel watch, the requests of every
call, how a failed try is retried or mapped to a TokenmillError, and how responses are read. The two clients
keep only what blocks or awaits: opening their kind of channel, sending a call and waiting before its retry."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar, cast

import grpc
import grpc.aio

from ._chat import MessageLike
from ._connect import ChannelWatch
from ._convert import (
    ChoicesBuilder,
    ResultBuilder,
    build_generate_request,
    build_tokenize_request,
    model_info_from_proto,
    tokenization_from_proto,
)
from ._options import GenerateOptions, GenerateOverrides, resolve_options
from ._proto import generate_pb2 as pb
from ._transport import (
    HEALTH_CHECK,
    LOAD_ADAPTER,
    LOAD_BALANCING_POLICIES,
    MODEL_INFO,
    TOKENIZE,
    UNLOAD_ADAPTER,
    ChannelOptions,
    Deadline,
    Method,
    RetryHook,
    Settings,
    decode_health_response,
    default_target,
    encode_health_request,
    read_root_certificates,
    retry_delay,
)
from ._types import GenerateEvent, GenerateResult, HealthStatus, ModelInfo, Tokenization
from .errors import TokenmillError, error_from_rpc

_Req = TypeVar("_Req")
_Resp = TypeVar("_Resp")
_T = TypeVar("_T")
_Channel = TypeVar("_Channel")


@dataclass(frozen=True, slots=True)
class UnaryCall(Generic[_Req, _Resp, _T]):
    """One unary call, ready to send: the RPC, its request, and what its response means to the caller."""

    method: Method[_Req, _Resp]
    request: _Req
    parse: Callable[[_Resp], _T]


def _nothing(response: object) -> None:
    return None


def tokenize_call(
    text_or_messages: str | Sequence[MessageLike],
) -> UnaryCall[pb.TokenizeRequest, pb.TokenizeResponse, Tokenization]:
    return UnaryCall(TOKENIZE, build_tokenize_request(text_or_messages), tokenization_from_proto)


def model_info_call() -> UnaryCall[pb.GetModelInfoRequest, pb.ModelInfo, ModelInfo]:
    return UnaryCall(MODEL_INFO, pb.GetModelInfoRequest(), model_info_from_proto)


def load_adapter_call(name: str, path: str) -> UnaryCall[pb.LoadLoRAAdapterRequest, pb.LoadLoRAAdapterResponse, None]:
    return UnaryCall(LOAD_ADAPTER, pb.LoadLoRAAdapterRequest(lora_name=name, lora_path=path), _nothing)


def unload_adapter_call(name: str) -> UnaryCall[pb.UnloadLoRAAdapterRequest, pb.UnloadLoRAAdapterResponse, None]:
    return UnaryCall(UNLOAD_ADAPTER, pb.UnloadLoRAAdapterRequest(lora_name=name), _nothing)


def health_call(service: str) -> UnaryCall[bytes, bytes, HealthStatus]:
    return UnaryCall(HEALTH_CHECK, encode_health_request(service), decode_health_response)


class Attempts:
    """The tries of one call: the deadline they share, and whether a failed one is tried again."""

    def __init__(self, settings: Settings, timeout: float | None) -> None:
        self._settings = settings
        self._deadline = Deadline(settings.timeout if timeout is None else timeout)
        self._retry = 0
        self.metadata = settings.metadata

    def timeout(self) -> float | None:
        """Seconds left for the next try (None: no deadline)."""
        return self._deadline.remaining()

    def delay(self, err: grpc.RpcError, *, retryable: bool = True) -> float:
        """Seconds to wait before trying again after ``err``; raises it as a TokenmillError when it is not
        tried again (not UNAVAILABLE, not ``retryable``, no retries or time left)."""
        delay = retry_delay(_code(err), self._settings, self._deadline, self._retry) if retryable else None
        if delay is None:
            raise error_from_rpc(err, self._settings.target) from err
        self._retry += 1
        return delay


class Collector(Generic[_T]):
    """Gathers the events of one stream into what generate_text() or generate_choices() returns."""

    def __init__(
        self,
        options: GenerateOptions,
        add: Callable[[GenerateEvent], None],
        finish: Callable[[], _T | None],
        target: str,
    ) -> None:
        self.options = options
        self.add = add
        self._finish = finish
        self._target = target

    def result(self) -> _T:
        value = self._finish()
        if value is None:
            message = "the server ended the stream without a finish reason"
            raise TokenmillError(message, grpc.StatusCode.UNKNOWN, target=self._target)
        return value


class ClientCore:
    """One client's settings and the watch over its channel, and what its calls are made of."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        # Looks at the channels to the target before this client's is created (open()).
        self.watch = ChannelWatch(settings.target)

    def open(self, make: Callable[[], _Channel]) -> _Channel:
        """The channel ``make`` creates, known to the watch as this client's."""
        channel = make()
        self.watch.found()
        return channel

    @property
    def every_address(self) -> bool:
        """Whether calls are spread over every address (so waiting for addresses waits for them all)."""
        return self.settings.load_balancing == "round_robin"

    def attempts(self, timeout: float | None) -> Attempts:
        return Attempts(self.settings, timeout)

    def generate_request(
        self,
        prompt: str | None,
        messages: Sequence[MessageLike] | None,
        token_ids: Sequence[int] | None,
        options: GenerateOptions | None,
        overrides: GenerateOverrides,
    ) -> tuple[pb.GenerateRequest, float | None]:
        """generate()'s request and its call's timeout (None: the client's default)."""
        resolved = resolve_options("generate", options, overrides)
        return build_generate_request(prompt, messages, token_ids, resolved), resolved.timeout

    def text(self, options: GenerateOptions | None, overrides: GenerateOverrides) -> Collector[GenerateResult]:
        """generate_text()'s options and what collects its one result."""
        resolved = resolve_options("generate_text", options, overrides)
        if resolved.n > 1:
            raise ValueError(f"generate_text returns one result; use generate_choices for n={resolved.n}")
        builder = ResultBuilder()
        return Collector(resolved, builder.add, builder.result, self.settings.target)

    def choices(
        self, options: GenerateOptions | None, overrides: GenerateOverrides
    ) -> Collector[tuple[GenerateResult, ...]]:
        """generate_choices()' options and what collects the result of each choice."""
        resolved = resolve_options("generate_choices", options, overrides)
        builder = ChoicesBuilder(resolved.n)
        return Collector(resolved, builder.add, builder.results, self.settings.target)


class ClientBase:
    """Client's and AsyncClient's constructor, and the server address it keeps; each opens its own kind of
    channel (_connect)."""

    # No docstring: help() and editors show each client's class docstring, which describes these parameters.
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
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        if timeout is not None and timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        if load_balancing is not None and load_balancing not in LOAD_BALANCING_POLICIES:
            raise ValueError(
                f"load_balancing must be one of {', '.join(LOAD_BALANCING_POLICIES)}, got {load_balancing!r}"
            )
        roots = read_root_certificates(root_certificates)
        settings = Settings(
            target=target or default_target(),
            tls=tls or roots is not None,
            root_certificates=roots,
            token=token,
            timeout=timeout,
            max_retries=max_retries,
            options=tuple(options),
            on_retry=on_retry,
            load_balancing=load_balancing,
        )
        self._core = ClientCore(settings)
        self._connect()

    def _connect(self) -> None:
        """Opens the client's channel with ``self._core.open`` (so that its watch knows it), and its stubs."""
        raise NotImplementedError

    @property
    def target(self) -> str:
        """The server address."""
        return self._core.settings.target


def _code(err: grpc.RpcError) -> grpc.StatusCode | None:
    code = getattr(err, "code", None)
    return code() if callable(code) else None


def cancel(call: grpc.RpcContext | grpc.aio.RpcContext) -> None:
    """Cancels a call: a no-op once it has finished."""
    # grpc-stubs leaves cancel() unannotated.
    cast("Callable[[], object]", call.cancel)()
