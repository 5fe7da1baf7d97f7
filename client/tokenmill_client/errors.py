"""Exceptions raised by the client: one class per gRPC status a caller can act on."""

from __future__ import annotations

import grpc


class TokenmillError(Exception):
    """A failed call. ``message`` is the server's (or gRPC's) message, ``code`` the gRPC status code."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None, *, target: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.target = target
        """The server address the call went to."""

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:
        code = self.code.name if self.code is not None else None
        return f"{type(self).__name__}({self.message!r}, code={code})"


class InvalidRequestError(TokenmillError):
    """The server rejected a parameter (INVALID_ARGUMENT); the message names it."""


class OverloadedError(TokenmillError):
    """The server's queue is full (RESOURCE_EXHAUSTED); retry later."""


class UnavailableError(TokenmillError):
    """The server cannot be reached, or is shutting down (UNAVAILABLE)."""


class DeadlineExceededError(TokenmillError):
    """The call's timeout passed before it finished (DEADLINE_EXCEEDED)."""


class AuthenticationError(TokenmillError):
    """The server refused the credentials (UNAUTHENTICATED)."""


class NotFoundError(TokenmillError):
    """What the call names does not exist on the server (NOT_FOUND): a LoRA adapter that is not loaded."""


_BY_CODE: dict[grpc.StatusCode, type[TokenmillError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequestError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: OverloadedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.UNAUTHENTICATED: AuthenticationError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
}


def error_from_code(code: grpc.StatusCode, details: str | None, target: str) -> TokenmillError:
    """The exception for a gRPC status code and its details."""
    message = " ".join((details or "").split())  # one line: gRPC's connection errors can span several
    if not message:
        message = f"call failed with status {code.name}"
    return _BY_CODE.get(code, TokenmillError)(message, code, target=target)


def error_from_rpc(error: grpc.RpcError, target: str) -> TokenmillError:
    """The exception for a failed gRPC call (sync or grpc.aio, whose errors carry code() and details())."""
    code_fn = getattr(error, "code", None)
    details_fn = getattr(error, "details", None)
    code = code_fn() if callable(code_fn) else grpc.StatusCode.UNKNOWN
    details = details_fn() if callable(details_fn) else str(error)
    if not isinstance(code, grpc.StatusCode):
        code = grpc.StatusCode.UNKNOWN
    return error_from_code(code, details if isinstance(details, str) else None, target)
