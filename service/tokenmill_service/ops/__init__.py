"""The hot operations by backend (see interface.py): the torch reference and the native CPU kernels
are always registered, triton when asked for."""

from tokenmill_service.ops import native_cpu_ops, torch_ops  # noqa: F401 - register "native" and "torch"
from tokenmill_service.ops.interface import (
    KVCacheLayout,
    Ops,
    available_backends,
    get_ops,
    ops_class,
    register_ops,
)

__all__ = ["KVCacheLayout", "Ops", "available_backends", "get_ops", "ops_class", "register_ops"]
