"""How a linear layer stores and multiplies its weight: one ``QuantMethod`` per scheme.

A linear layer owns a method chosen at load (vLLM's ``QuantizeMethodBase`` is the model):

- ``create_weights`` registers the layer's tensors for its (per-rank) shape;
- ``load_rows`` writes a checkpoint tensor, already cut to this rank's columns, into a range of
  the layer's output rows (packed q/k/v and gate/up arrive as several such pieces);
- ``finalize`` turns what was loaded into the kernel's layout, once every piece is in;
- ``apply`` is the matrix product ``x @ W.T`` (no bias; the layer adds it).

Methods register under a name (``@register_quantization("int4")``) and are picked by
``--quantization``; a test can register its own without touching the model. The load plan
(worker/plan/resolve.py) asks each method where it can run (``unavailable_reason``) and which of its
kernels it runs there (``kernel_for``), once; the method is then built with that kernel.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from tokenmill_service.contract.plan import choices
from tokenmill_service.worker.layers.quant.gguf_blocks import CheckpointTensor
from tokenmill_service.worker.registry import Registry

if TYPE_CHECKING:
    from tokenmill_service.worker.device import DeviceFacts
    from tokenmill_service.worker.layers.linear import LinearBase


class QuantMethod(ABC):
    name: ClassVar[str]
    # Native entry points (library, symbol; signature as block_gemm.cpp's) by kernel name: where
    # the method's kernel is one, native code may call it directly on ``native_operands``
    # (worker/kernels/cpu/decoder_stack.py).
    native_entry_points: ClassVar[dict[str, tuple[str, str]]] = {}

    def __init__(self, act_dtype: torch.dtype, kernel: str | None = None) -> None:
        # The dtype of the activations this layer multiplies (and returns).
        self.act_dtype = act_dtype
        # The kernel the plan chose (None, outside a plan: the one this machine's CPU would get).
        if kernel is None:
            from tokenmill_service.worker.device import probe_device

            kernel = self.kernel_for(probe_device("cpu"), act_dtype)
        self.kernel = kernel

    @classmethod
    def unavailable_reason(cls, facts: DeviceFacts, act_dtype: torch.dtype) -> str | None:
        """None where this method can run at ``act_dtype`` on the device of ``facts``, else why not."""
        return None

    @classmethod
    def kernel_for(cls, facts: DeviceFacts, act_dtype: torch.dtype) -> str:
        """The kernel this method multiplies with there (a name for reports; most methods have one)."""
        return cls.name

    @property
    def native_kernel(self) -> tuple[str, str] | None:
        """The native entry point of this layer's kernel, or None where it is not a native kernel."""
        return self.native_entry_points.get(self.kernel)

    @abstractmethod
    def create_weights(self, layer: LinearBase, out_features: int, in_features: int) -> None: ...

    @abstractmethod
    def load_rows(self, layer: LinearBase, rows: slice, tensor: CheckpointTensor) -> None: ...

    def finalize(self, layer: LinearBase) -> None:
        """Called once after every piece of the layer's weight is loaded."""

    @abstractmethod
    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor: ...

    def native_operands(self, layer: LinearBase) -> tuple[torch.Tensor, int]:
        """Where ``native_kernel`` is set: the weights it reads and their format (a ggml type id)."""
        raise NotImplementedError(f"{self.name} has no native kernel")

    @abstractmethod
    def dequantized(self, layer: LinearBase) -> torch.Tensor:
        """The weight [out, in] as float32, as the kernel sees it (for tests and reports)."""

    @abstractmethod
    def weight_bytes(self, layer: LinearBase) -> int:
        """Bytes a matrix product reads for the weight (what bandwidth figures count)."""


_METHODS: Registry[type[QuantMethod]] = Registry("quantization", choices.QUANTIZATION, also=", or auto")

# Class decorator: make a method selectable as ``--quantization name``.
register_quantization = _METHODS.register
quant_method_class = _METHODS.get
available_quantizations = _METHODS.names


def kernel_dtype(act_dtype: torch.dtype) -> torch.dtype:
    """The weight-only kernels run in bfloat16 (their float32 paths are many times slower);
    float32 activations reach them as two bfloat16 halves."""
    return torch.bfloat16 if act_dtype == torch.float32 else act_dtype


def split_bf16_matmul(kernel: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``kernel(x)`` for float32 ``x`` through a bfloat16 kernel, without rounding ``x`` to bfloat16.

    x = hi + lo with hi = bf16(x) and lo = bf16(x - hi) (16 bits of mantissa between them); both
    go through the kernel in one call, as extra rows, so the weights are read once; the two
    products are added in float32. What remains is the kernel's own rounding (its bfloat16 output
    and scales). Rows stay independent: a row's result does not depend on the others.
    Activations already in bfloat16 go through as they are.
    """
    if x.dtype != torch.float32:
        return kernel(x)
    hi = x.to(torch.bfloat16)
    lo = (x - hi.float()).to(torch.bfloat16)
    y = kernel(torch.cat((hi, lo))).float()
    m = x.shape[0]
    return y[:m] + y[m:]


def empty_param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
