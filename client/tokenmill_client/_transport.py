"""Connection settings, the RPCs (typed, for sync and grpc.aio channels), retry timing and the hand-coded health check."""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import grpc
import grpc.aio

from ._proto import generate_pb2 as pb
from ._types import HealthStatus

ENV_SERVER = "TOKENMILL_SERVER"
DEFAULT_TARGET = "localhost:50051"

_SERVICE = "/tokenmill.v1.Generation/"
GENERATE_METHOD = _SERVICE + "Generate"
TOKENIZE_METHOD = _SERVICE + "Tokenize"
MODEL_INFO_METHOD = _SERVICE + "GetModelInfo"
LOAD_ADAPTER_METHOD = _SERVICE + "LoadLoRAAdapter"
UNLOAD_ADAPTER_METHOD = _SERVICE + "UnloadLoRAAdapter"
HEALTH_CHECK_METHOD = "/grpc.health.v1.Health/Check"

_MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # prompt logprobs of a long prompt can pass gRPC's 4 MiB default

# gRPC's client-side load-balancing policies: pick_first (gRPC's default: one connection, to the first
# address that answers) or round_robin (a connection to every address the target resolves to, calls
# spread over them in turn; with a dns:/// target, a headless Service's pods).
LOAD_BALANCING_POLICIES = ("pick_first", "round_robin")

_Req = TypeVar("_Req")
_Resp = TypeVar("_Resp")

ChannelOptions = Sequence[tuple[str, Any]]
# Called before each retry's wait with the retry number (0-based) and the seconds it will wait.
RetryHook = Callable[[int, float], None]


def default_target() -> str:
    """$TOKENMILL_SERVER, else localhost:50051."""
    return os.environ.get(ENV_SERVER) or DEFAULT_TARGET


def read_root_certificates(value: bytes | str | os.PathLike[str] | None) -> bytes | None:
    """PEM root certificates given as bytes, or as the path of a PEM file."""
    if value is None or isinstance(value, bytes):
        return value
    with open(value, "rb") as f:
        return f.read()


@dataclass(frozen=True, slots=True)
class Settings:
    """What every call of one client shares."""

    target: str
    tls: bool
    root_certificates: bytes | None
    token: str | None
    timeout: float | None
    max_retries: int
    initial_backoff: float = 0.2
    max_backoff: float = 2.0
    options: tuple[tuple[str, Any], ...] = ()
    on_retry: RetryHook | None = None
    load_balancing: str | None = None

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def channel_options(self) -> list[tuple[str, Any]]:
        options: list[tuple[str, Any]] = [
            ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
        ]
        if self.load_balancing is not None:
            config: dict[str, Any] = {"loadBalancingConfig": [{self.load_balancing: {}}]}
            options.append(("grpc.service_config", json.dumps(config)))
        return [*options, *self.options]

    def backoff(self, retry: int) -> float:
        """Seconds to wait before retry number ``retry`` (0-based): exponential, capped, with jitter."""
        base = min(self.max_backoff, self.initial_backoff * 2.0**retry)
        return base * random.uniform(0.8, 1.2)

    def sync_channel(self) -> grpc.Channel:
        if self.tls:
            creds = grpc.ssl_channel_credentials(root_certificates=self.root_certificates)
            return grpc.secure_channel(self.target, creds, options=self.channel_options())
        return grpc.insecure_channel(self.target, options=self.channel_options())

    def aio_channel(self) -> grpc.aio.Channel:
        if self.tls:
            creds = grpc.ssl_channel_credentials(root_certificates=self.root_certificates)
            return grpc.aio.secure_channel(self.target, creds, options=self.channel_options())
        return grpc.aio.insecure_channel(self.target, options=self.channel_options())


def retry_delay(code: grpc.StatusCode | None, settings: Settings, deadline: Deadline, retry: int) -> float | None:
    """Seconds to wait before retrying a call that failed with ``code``, or None not to retry.

    Only UNAVAILABLE is retried (the server was not reached, or is restarting), ``settings.max_retries``
    times at most, and only while the deadline leaves room for the wait; ``settings.on_retry`` hears of each.
    """
    if code is not grpc.StatusCode.UNAVAILABLE or retry >= settings.max_retries:
        return None
    delay = settings.backoff(retry)
    if not deadline.allows(delay):
        return None
    if settings.on_retry is not None:
        settings.on_retry(retry, delay)
    return delay


@dataclass(frozen=True, slots=True)
class Method(Generic[_Req, _Resp]):
    """One RPC: its path and how its messages are written and read (the generated _grpc stub is untyped)."""

    path: str
    serialize: Callable[[_Req], bytes]
    deserialize: Callable[[bytes], _Resp]

    def unary(self, channel: grpc.Channel) -> grpc.UnaryUnaryMultiCallable[_Req, _Resp]:
        return channel.unary_unary(self.path, request_serializer=self.serialize, response_deserializer=self.deserialize)

    def aio_unary(self, channel: grpc.aio.Channel) -> grpc.aio.UnaryUnaryMultiCallable[_Req, _Resp]:
        return channel.unary_unary(self.path, request_serializer=self.serialize, response_deserializer=self.deserialize)

    def stream(self, channel: grpc.Channel) -> grpc.UnaryStreamMultiCallable[_Req, _Resp]:
        return channel.unary_stream(
            self.path, request_serializer=self.serialize, response_deserializer=self.deserialize
        )

    def aio_stream(self, channel: grpc.aio.Channel) -> grpc.aio.UnaryStreamMultiCallable[_Req, _Resp]:
        return channel.unary_stream(
            self.path, request_serializer=self.serialize, response_deserializer=self.deserialize
        )


def _identity(data: bytes) -> bytes:
    return data


GENERATE: Method[pb.GenerateRequest, pb.GenerateResponse] = Method(
    GENERATE_METHOD, pb.GenerateRequest.SerializeToString, pb.GenerateResponse.FromString
)
TOKENIZE: Method[pb.TokenizeRequest, pb.TokenizeResponse] = Method(
    TOKENIZE_METHOD, pb.TokenizeRequest.SerializeToString, pb.TokenizeResponse.FromString
)
MODEL_INFO: Method[pb.GetModelInfoRequest, pb.ModelInfo] = Method(
    MODEL_INFO_METHOD, pb.GetModelInfoRequest.SerializeToString, pb.ModelInfo.FromString
)
LOAD_ADAPTER: Method[pb.LoadLoRAAdapterRequest, pb.LoadLoRAAdapterResponse] = Method(
    LOAD_ADAPTER_METHOD, pb.LoadLoRAAdapterRequest.SerializeToString, pb.LoadLoRAAdapterResponse.FromString
)
UNLOAD_ADAPTER: Method[pb.UnloadLoRAAdapterRequest, pb.UnloadLoRAAdapterResponse] = Method(
    UNLOAD_ADAPTER_METHOD, pb.UnloadLoRAAdapterRequest.SerializeToString, pb.UnloadLoRAAdapterResponse.FromString
)
HEALTH_CHECK: Method[bytes, bytes] = Method(HEALTH_CHECK_METHOD, _identity, _identity)


class Deadline:
    """One call's overall deadline, shared by its retries."""

    def __init__(self, timeout: float | None) -> None:
        self._end = None if timeout is None else time.monotonic() + timeout

    def remaining(self) -> float | None:
        if self._end is None:
            return None
        return max(0.0, self._end - time.monotonic())

    def allows(self, seconds: float) -> bool:
        """Whether waiting ``seconds`` still leaves time for another attempt."""
        remaining = self.remaining()
        return remaining is None or remaining > seconds


def encode_health_request(service: str) -> bytes:
    """grpc.health.v1.HealthCheckRequest {string service = 1} in protobuf wire format."""
    if not service:
        return b""
    raw = service.encode("utf-8")
    return b"\x0a" + _encode_varint(len(raw)) + raw


def decode_health_response(data: bytes) -> HealthStatus:
    """grpc.health.v1.HealthCheckResponse {ServingStatus status = 1}; unknown fields are skipped."""
    status = 0
    pos = 0
    while pos < len(data):
        key, pos = _decode_varint(data, pos)
        field, wire_type = key >> 3, key & 7
        if wire_type == 0:
            value, pos = _decode_varint(data, pos)
            if field == 1:
                status = value
        elif wire_type == 1:
            pos += 8
        elif wire_type == 2:
            length, pos = _decode_varint(data, pos)
            pos += length
        elif wire_type == 5:
            pos += 4
        else:
            raise ValueError(f"malformed health check response (wire type {wire_type})")
    if pos > len(data):
        raise ValueError("truncated health check response")
    statuses = (HealthStatus.UNKNOWN, HealthStatus.SERVING, HealthStatus.NOT_SERVING, HealthStatus.SERVICE_UNKNOWN)
    return statuses[status] if status < len(statuses) else HealthStatus.UNKNOWN


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        bits = value & 0x7F
        value >>= 7
        if value:
            out.append(bits | 0x80)
        else:
            out.append(bits)
            return bytes(out)


def _decode_varint(data: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise ValueError("truncated or oversized varint in health check response")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
