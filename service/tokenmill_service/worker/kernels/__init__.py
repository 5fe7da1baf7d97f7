"""Every kernel in one home, and the one registry of ops backends (interface.py).

    interface.py    the ops a decoder calls, the ``KVCacheLayout`` a backend owns, the registry
    torch_ops.py    ``torch``: the plain-torch reference, on any device
    cpu/            ``native``: tokenmill's C++ CPU kernels (abi.py, build.py, one binding each) and
                    their ops backend (cpu/ops.py); also the block products the quant methods call
    triton/         ``triton``: one Triton kernel a file, beside the backend (registered when asked for)
    attention_metadata.py  the per-step tensors every backend's attention reads
    attention_params.py    a layer's attention parameters (scale, window, soft cap, sinks; MLA's
                           up-projections and cache pair), built once by the layer

The load plan (worker/plan/resolve.py) asks the registered backends where they run and picks one; nothing
else swaps ops in. Code outside this package imports from here only: the ops registry, and the native
bindings the quantization methods, LoRA slots, the experts' call, the decoder stack and the sampler call.
"""

from tokenmill_service.worker.kernels import torch_ops  # noqa: F401 - registers "torch"
from tokenmill_service.worker.kernels.cpu import (
    abi,
    block_gemm,
    build,
    decoder_stack,
    kquant_gemm,
    lora,
    moe_mlp,
    stack_profile,
    vnni_gemm,
)
from tokenmill_service.worker.kernels.cpu import ops as cpu_ops  # noqa: F401 - registers "native"
from tokenmill_service.worker.kernels.cpu.moe_mlp import NativeExperts
from tokenmill_service.worker.kernels.cpu.sampling import argmax_rows, log_softmax, softmax
from tokenmill_service.worker.kernels.interface import (
    KVCacheLayout,
    LatentCacheLayout,
    LoRADelta,
    LoRAStack,
    Ops,
    available_backends,
    get_ops,
    ops_class,
    register_ops,
)

__all__ = [
    "KVCacheLayout",
    "LatentCacheLayout",
    "LoRADelta",
    "LoRAStack",
    "NativeExperts",
    "Ops",
    "abi",
    "argmax_rows",
    "available_backends",
    "block_gemm",
    "build",
    "decoder_stack",
    "get_ops",
    "kquant_gemm",
    "log_softmax",
    "lora",
    "moe_mlp",
    "ops_class",
    "register_ops",
    "softmax",
    "stack_profile",
    "vnni_gemm",
]
