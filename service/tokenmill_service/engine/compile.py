"""The compiled forward pass (``--compile``): the model's regions through ``torch.compile``.

What is compiled is what the model hands over in ``compile_regions``: for a Llama, the work of a
layer before attention (residual add, norm, q/k/v projection, rotary) and after it (output
projection, norm, MLP), the final norm and the head. Attention and the KV cache writes stay eager
between them: their work depends on the batch's shape (how many sequences, how much context), the
regions' only on the number of tokens.

One graph per region serves every step, prefill chunks and decode tokens alike: the token
dimension is marked dynamic, and a lone token is run as two rows (a repeated one), because
torch.compile specializes a dimension of size 1 into a graph of its own. That keeps two promises:
every row is computed by the same code whatever else is in the step (batch invariance, as the
eager path keeps it), and the worker's warm-up builds every graph the serving path will use, so no
request waits for a compilation. ``compiled_graphs`` counts them (the ``tokenmill_compiled_graphs``
gauge); it does not move after the warm-up.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, Protocol

import structlog
import torch

log = structlog.get_logger(__name__)

COMPILE_SETTINGS = ("auto", "off")


class Compilable(Protocol):
    @property
    def device(self) -> torch.device: ...

    def compile_regions(self, compile: Callable[[Callable[..., Any]], Callable[..., Any]] | None) -> None: ...


def why_not_compiled(model: Compilable, backend: str, tensor_parallel: int) -> str | None:
    """Why ``--compile auto`` leaves this worker eager, or None when it compiles."""
    if not hasattr(model, "compile_regions"):
        return "the model has no compilable regions"
    if backend != "torch":
        return f"the {backend} backend runs its own kernels"
    if tensor_parallel > 1:
        return "tensor-parallel ranks run eager (collectives inside compiled regions are not supported yet)"
    if model.device.type != "cpu":
        return f"compiling for {model.device.type} (CUDA graphs) is not implemented yet"
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        get_cpp_compiler()
    except Exception as exc:  # noqa: BLE001 - whatever inductor raises when it finds no compiler
        return f"no C++ compiler for inductor ({exc}); install g++ or set CXX"
    return None


def compile_model(model: Compilable, setting: str, backend: str = "torch", tensor_parallel: int = 1) -> bool:
    """Put the model's regions through torch.compile (they compile on first use: run the warm-up next).
    False, with one log line saying why, where the worker stays eager."""
    if setting not in COMPILE_SETTINGS:
        raise ValueError(f"--compile must be one of {', '.join(COMPILE_SETTINGS)}, not {setting!r}")
    if setting == "off":
        return False
    reason = why_not_compiled(model, backend, tensor_parallel)
    if reason is not None:
        log.warning("compile_skipped", reason=reason, running="eager")
        return False
    import torch._inductor.config as inductor_config

    # Compile in this process: a pool of compile workers would outlive a worker that is killed.
    inductor_config.compile_threads = 1
    # Keep every rounding the code asks for: float32 activations reach the bfloat16 kernels as
    # hi = bf16(x) and lo = bf16(x - hi), which is only right if hi is really rounded.
    inductor_config.emulate_precision_casts = True
    model.compile_regions(compiled_region)
    return True


def compiled_region(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn(module, *tensors)`` compiled once for any number of tokens (dimension 0 of every tensor)."""
    compiled = torch.compile(fn, fullgraph=True, dynamic=False)

    def run(module: torch.nn.Module, *args: torch.Tensor | None) -> Any:
        first = next(a for a in args if a is not None)
        n = first.shape[0]
        if n == 1:
            args = tuple(None if a is None else torch.cat((a, a)) for a in args)
        for a in args:
            if a is not None:
                torch._dynamo.mark_dynamic(a, 0)
        out = compiled(module, *args)
        if n == 1:
            out = tuple(o[:1] for o in out) if isinstance(out, tuple) else out[:1]
        return out

    return run


def compiled_graphs() -> int:
    """Graphs torch.compile has built in this process (0 when it was never used)."""
    if "torch._dynamo" not in sys.modules:
        return 0
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
