"""The router: between the servicer and the worker processes, in the server's (torch-free) process.

- ``dispatch.py``: ``Router``: admission, dispatch, resumption, cancellation
- ``choice.py``: ``ReplicaChooser``: which replica runs a request (prefix-aware or least-load)
- ``prefix_index.py``: ``PrefixIndex``: the prompt blocks the router sent to each replica (bounded)
- ``replicas.py``: ``ReplicaPool``: the worker processes, their pipes, supervision and restarts
- ``spec.py``: what each worker process is started with (the load options whole, limits, threads)
- ``streams.py``: one admitted request, as kept for resumption and as its caller reads it
- ``errors.py``: what a request's stream can end with (each one gRPC status: ``status_of``)
"""

from tokenmill_service.front.router.dispatch import Router
from tokenmill_service.front.router.errors import (
    AdapterInUse,
    AdapterNotFound,
    AdapterRefused,
    DeadlineExceeded,
    Overloaded,
    Rejected,
    RouterError,
    ShuttingDown,
    Unavailable,
    WorkerStartError,
    status_of,
)
from tokenmill_service.front.router.streams import RequestStream

__all__ = [
    "AdapterInUse",
    "AdapterNotFound",
    "AdapterRefused",
    "DeadlineExceeded",
    "Overloaded",
    "Rejected",
    "RequestStream",
    "Router",
    "RouterError",
    "ShuttingDown",
    "Unavailable",
    "WorkerStartError",
    "status_of",
]
