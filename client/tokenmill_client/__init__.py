"""Typed Python client of the tokenmill text-generation service.

    from tokenmill_client import Client

    with Client("localhost:50051") as client:
        for event in client.generate(messages=[("user", "What is the capital of France?")], max_new_tokens=32):
            print(event.text, end="", flush=True)

The base install needs only grpcio and protobuf.
"""

from __future__ import annotations

from importlib import metadata as _metadata

from ._chat import ChatMessage, FunctionChoice, MessageLike, Tool, ToolCall, ToolChoice, ToolLike
from ._connect import Connections
from ._options import GenerateOptions, GenerateOverrides
from ._types import (
    EngineState,
    FinishReason,
    GenerateEvent,
    GenerateResult,
    HealthStatus,
    Limits,
    ModelInfo,
    RankState,
    Timing,
    Token,
    Tokenization,
    TopLogprob,
    Usage,
    WorkerState,
)
from .aio import AsyncClient
from .client import Client
from .errors import (
    AuthenticationError,
    DeadlineExceededError,
    InvalidRequestError,
    NotFoundError,
    OverloadedError,
    TokenmillError,
    UnavailableError,
)

try:
    __version__ = _metadata.version("tokenmill")
except _metadata.PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+unknown"

__all__ = [
    "AsyncClient",
    "AuthenticationError",
    "ChatMessage",
    "Client",
    "Connections",
    "DeadlineExceededError",
    "EngineState",
    "FinishReason",
    "FunctionChoice",
    "GenerateEvent",
    "GenerateOptions",
    "GenerateOverrides",
    "GenerateResult",
    "HealthStatus",
    "InvalidRequestError",
    "Limits",
    "MessageLike",
    "ModelInfo",
    "NotFoundError",
    "OverloadedError",
    "RankState",
    "Timing",
    "Token",
    "Tokenization",
    "TokenmillError",
    "Tool",
    "ToolCall",
    "ToolChoice",
    "ToolLike",
    "TopLogprob",
    "UnavailableError",
    "Usage",
    "WorkerState",
    "__version__",
]
