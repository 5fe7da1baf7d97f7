"""The compiled forward pass (``--compile auto``, the ``compiled`` executor): the model's regions
through ``torch.compile``. The load plan decides whether a worker compiles (worker/plan/resolve.py).

What is compiled is the model's ``regions_type``: for a Llama, the work of a
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
from typing import Any

import torch


def configure_inductor() -> None:
    """Inductor's settings for tokenmill's regions (set before the first compilation)."""
    import torch._inductor.config as inductor_config

    # Compile in this process: a pool of compile workers would outlive a worker that is killed.
    inductor_config.compile_threads = 1
    # Keep every rounding the code asks for: float32 activations reach the bfloat16 kernels as
    # hi = bf16(x) and lo = bf16(x - hi), which is only right if hi is really rounded.
    inductor_config.emulate_precision_casts = True
    pin_vector_width(inductor_config)


def pin_vector_width(inductor_config: Any) -> None:
    """Name the CPU vector width inductor generates code for in its config, which its FX graph cache
    is keyed on. It picks the widest vector ISA the CPU runs, or the one ``ATEN_CPU_CAPABILITY``
    names, but does not key the cache on it: a graph cached under AVX-512 (loops of 16 lanes) was
    reused under ``ATEN_CPU_CAPABILITY=avx2`` (or from a cache directory another CPU filled) and
    compiled for 8-lane vectors, leaving half of each output unwritten (garbage, NaNs). With the
    width named, inductor picks the same ISA and a cache entry holds for that width only."""
    from torch._inductor import cpu_vec_isa

    if inductor_config.cpp.simdlen is not None:
        return
    isa = cpu_vec_isa.pick_vec_isa()
    if not isa.bit_width():
        return
    inductor_config.cpp.simdlen = isa.bit_width()
    if type(cpu_vec_isa.pick_vec_isa()) is not type(isa):  # another ISA of that width comes first: leave it
        inductor_config.cpp.simdlen = None


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
