"""What a caller of the router sees go wrong; each maps to one gRPC status (status_of), which the servicer
answers it with."""

from __future__ import annotations

import grpc


class RouterError(Exception):
    """Base of the errors a request's stream ends with."""


class Unavailable(RouterError):
    """No replica can take the request now (none ready, all dead, shutting down): UNAVAILABLE."""


class ShuttingDown(Unavailable):
    """The server is draining (SIGTERM, Ctrl-C): it admits nothing new, whatever its replicas. The message
    holds for one server as for several behind one address, since the server cannot know which it is."""

    def __init__(self) -> None:
        super().__init__(
            "the server is shutting down and takes no new requests; retry when it is back, "
            "or on another server if one serves this address"
        )


class Overloaded(RouterError):
    """Every replica's batch and the admission queue are full: RESOURCE_EXHAUSTED."""


class DeadlineExceeded(RouterError):
    """The caller's deadline passed before generation ended: DEADLINE_EXCEEDED."""


class Rejected(RouterError):
    """The worker's engine refused the request (a limit the servicer could not check): INVALID_ARGUMENT."""


class AdapterNotFound(RouterError):
    """A request or an unload names a LoRA adapter that is not loaded: NOT_FOUND / 404."""


class AdapterRefused(RouterError):
    """A LoRA adapter that cannot be loaded on this base (the message names the mismatch): INVALID_ARGUMENT / 400."""


class AdapterInUse(RouterError):
    """An unload of a LoRA adapter that requests still use: FAILED_PRECONDITION / 409."""


class WorkerStartError(RuntimeError):
    """A replica failed to load its model or to run its warm-up step; ``usage`` where the checkpoint or
    the flags cannot be served as asked (the server then exits as for a bad flag)."""

    def __init__(self, message: str, usage: bool = False) -> None:
        super().__init__(message)
        self.usage = usage


# The status each is answered with (that of the first class the error is an instance of).
_STATUS: tuple[tuple[type[RouterError], grpc.StatusCode], ...] = (
    (Unavailable, grpc.StatusCode.UNAVAILABLE),
    (Overloaded, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED),
    (Rejected, grpc.StatusCode.INVALID_ARGUMENT),
    (AdapterNotFound, grpc.StatusCode.NOT_FOUND),
    (AdapterRefused, grpc.StatusCode.INVALID_ARGUMENT),
    (AdapterInUse, grpc.StatusCode.FAILED_PRECONDITION),
)


def status_of(exc: RouterError) -> grpc.StatusCode | None:
    """The gRPC status a caller is answered ``exc`` with; None for another RouterError, which is not the
    caller's to see (a fault of the server's)."""
    return next((status for kind, status in _STATUS if isinstance(exc, kind)), None)
