"""Every kernel in one home, and the one registry of ops backends (interface.py).

    interface.py    the ops a decoder calls, the ``KVCacheLayout`` a backend owns, the registry
    torch_ops.py    ``torch``: the plain-torch reference, on any device
    cpu/            ``native``: tokenmill's C++ CPU kernels (abi.py, build.py, one binding each) and
                    their ops backend (cpu/ops.py); also the block products the quant methods call
    triton/         ``triton``: one Triton kernel a file, beside the backend (registered when asked for)
    attention_metadata.py  the per-step tensors every backend's attention reads

The load plan (plan/resolve.py) asks the registered backends where they run and picks one; nothing
else swaps ops in.
"""

from tokenmill_service.kernels import torch_ops  # noqa: F401 - registers "torch"
from tokenmill_service.kernels.cpu import ops as cpu_ops  # noqa: F401 - registers "native"
from tokenmill_service.kernels.interface import (
    KVCacheLayout,
    LatentCacheLayout,
    Ops,
    available_backends,
    get_ops,
    ops_class,
    register_ops,
)

__all__ = ["KVCacheLayout", "LatentCacheLayout", "Ops", "available_backends", "get_ops", "ops_class", "register_ops"]
