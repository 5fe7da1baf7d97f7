"""GGUF's block formats served as stored: ``--quantization gguf`` (the default for a GGUF on a CPU).

The layer keeps the file's own bytes (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL or MXFP4: a scale, for Q4_1 and
Q5_1 a float16 minimum, and 32 quantized weights per block) and multiplies them with tokenmill's native kernel
(``worker/kernels/cpu/block_gemm.cpp``): float32 activations, each weight dequantized exactly as gguf
does, float32 sums in an order fixed per output, so a row's result is the same whatever else is in
its batch. Unlike the int4/int8 methods nothing is rounded to bfloat16 on the way, so the served
default is as close to the float32 reference as the file allows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch
from gguf import GGMLQuantizationType as QType

from tokenmill_service.worker.kernels import block_gemm as native
from tokenmill_service.worker.kernels import vnni_gemm as vnni
from tokenmill_service.worker.layers.quant.base import QuantMethod, register_quantization
from tokenmill_service.worker.layers.quant.gguf_blocks import (
    BLOCK_BYTES,
    QUANT_BLOCK,
    CheckpointTensor,
    GGUFBlocks,
    describe,
)

if TYPE_CHECKING:
    from tokenmill_service.worker.device import DeviceFacts
    from tokenmill_service.worker.layers.linear import LinearBase

# The formats the kernels read.
SERVED_TYPES = frozenset(qtype for qtype in BLOCK_BYTES if int(qtype) in native.FORMATS)


@register_quantization("gguf")
class GGUFBlocksMethod(QuantMethod):
    native_entry_points: ClassVar[dict[str, tuple[str, str]]] = {"block_gemm": ("block_gemm", "tm_block_gemm")}
    # The tensor types a GGUF method multiplies as stored (the plan gives it no other layer), and
    # the weights per block of those formats (a layer's input features hold whole blocks).
    served_types: ClassVar[frozenset[QType]] = SERVED_TYPES
    block_weights: ClassVar[int] = QUANT_BLOCK

    @classmethod
    def unavailable_reason(cls, facts: DeviceFacts, act_dtype: torch.dtype) -> str | None:
        if act_dtype != torch.float32:
            return f"it takes float32 activations, and --dtype is {str(act_dtype).removeprefix('torch.')}"
        return facts.native(cls.kernel_for(facts, act_dtype))

    @classmethod
    def kernel_for(cls, facts: DeviceFacts, act_dtype: torch.dtype) -> str:
        return "block_gemm"

    def create_weights(self, layer: LinearBase, out_features: int, in_features: int) -> None:
        if in_features % self.block_weights:
            raise ValueError(
                f"{self.name} needs input features divisible by {self.block_weights}; this layer has {in_features}"
            )
        layer.qtype = None
        # Sized at the first load, once the checkpoint says which format the layer is stored in.
        layer.register_buffer("blocks", torch.empty(0, dtype=torch.uint8))

    def load_rows(self, layer: LinearBase, rows: slice, tensor: CheckpointTensor) -> None:
        if not isinstance(tensor, GGUFBlocks) or tensor.qtype not in self.served_types:
            names = ", ".join(sorted(t.name for t in self.served_types))
            raise ValueError(f"--quantization {self.name} serves {names} tensors as stored, not {describe(tensor)}")
        if layer.qtype is None:
            layer.qtype = tensor.qtype
            shape = (layer.out_features, tensor.data.shape[1], tensor.data.shape[2])
            layer.blocks = torch.empty(shape, dtype=torch.uint8, device=layer.blocks.device)
        elif tensor.qtype != layer.qtype:
            raise ValueError(f"one layer stored as both {layer.qtype.name} and {tensor.qtype.name}")
        layer.blocks[rows] = tensor.data

    @staticmethod
    def _format(layer: LinearBase) -> int:
        """The layer's format, a ggml type id (known from its first load)."""
        if layer.qtype is None:
            raise RuntimeError("the layer's weights are not loaded")
        return int(layer.qtype)

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        y = native.block_gemm(x, layer.blocks, self._format(layer), layer.out_features)
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    def native_operands(self, layer: LinearBase) -> tuple[torch.Tensor, int]:
        return layer.blocks, self._format(layer)

    def dequantized(self, layer: LinearBase) -> torch.Tensor:
        return native.block_dequantize(layer.blocks, self._format(layer))

    def weight_bytes(self, layer: LinearBase) -> int:
        return layer.blocks.numel()


@register_quantization("gguf-vnni")
class GGUFBlocksVnniMethod(GGUFBlocksMethod):
    """The same blocks multiplied with integer products (``worker/kernels/cpu/vnni_gemm.cpp``, on every instruction set):
    activations as 16-bit fixed point per block of 32 (two int8 digits), exact integer sums,
    float32 scales. 2.1 to 2.7 times the float32 kernel's rate; logprobs
    within about 1e-3 of the float32 reference. Rows stay independent, each output reduced in a
    fixed order, so a sequence's results do not depend on its batch."""

    # vnni_gemm_int8: the plan's choice under --activations int8 (the same signature, 8-bit activations).
    native_entry_points: ClassVar[dict[str, tuple[str, str]]] = {
        "vnni_gemm": ("vnni_gemm", "tm_vnni_gemm"),
        "vnni_gemm_int8": ("vnni_gemm", "tm_vnni_gemm_int8"),
    }

    @classmethod
    def kernel_for(cls, facts: DeviceFacts, act_dtype: torch.dtype) -> str:
        return "vnni_gemm"

    def finalize(self, layer: LinearBase) -> None:
        # The kernel's layout (groups of 16 rows, as many bytes as the file's blocks) replaces them.
        layer.blocks = vnni.pack(layer.blocks, self._format(layer))

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        y = vnni.vnni_gemm(x, layer.blocks, self._format(layer), layer.out_features, self.kernel == "vnni_gemm_int8")
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    def dequantized(self, layer: LinearBase) -> torch.Tensor:
        return vnni.unpack(layer.blocks, self._format(layer), layer.out_features, layer.in_features)
