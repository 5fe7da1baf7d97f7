"""llama.cpp's k-quants served as stored: ``--quantization gguf-kquant`` (chosen by the load plan for
a GGUF's Q2_K, Q3_K, Q4_K, Q5_K, Q6_K and IQ4_XS layers, as in the Q4_K_M, Q5_K_M, Q6_K and Q3_K_M files
people download).

The layer keeps the file's super-blocks (256 weights: float16 d and dmin, per sub-block a scale and
a minimum, 2 to 6 bits a weight), repacked at load into the kernel's layout at about the file's size
(``worker/kernels/cpu/kquant_gemm.cpp``), and multiplies
them with integer products as ``gguf-vnni`` does
the 32-weight formats: 16-bit fixed-point activations, exact integer sums, float32 scales in an
order fixed per output, so a row's result does not depend on its batch. Every weight is exactly
what gguf dequantizes it to. A packed layer whose parts are stored in different k-quants (Q4_K_M
files keep some layers' v projection in Q6_K beside Q4_K q and k) is packed as segments and still
multiplied in one call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch
from gguf import GGMLQuantizationType as QType

from tokenmill_service.worker.kernels import kquant_gemm as kq
from tokenmill_service.worker.layers.quant.base import register_quantization
from tokenmill_service.worker.layers.quant.blocks import GGUFBlocksMethod
from tokenmill_service.worker.layers.quant.gguf_blocks import CheckpointTensor, GGUFBlocks, describe

if TYPE_CHECKING:
    from tokenmill_service.worker.device import DeviceFacts
    from tokenmill_service.worker.layers.linear import LinearBase


@register_quantization("gguf-kquant")
class GGUFKQuantMethod(GGUFBlocksMethod):
    # kquant_gemm_int8: the plan's choice under --activations int8 (the same signature, 8-bit activations).
    native_entry_points: ClassVar[dict[str, tuple[str, str]]] = {
        "kquant_gemm": ("kquant_gemm", "tm_kquant_gemm"),
        "kquant_gemm_int8": ("kquant_gemm", "tm_kquant_gemm_int8"),
    }
    served_types: ClassVar[frozenset[QType]] = frozenset(QType(fmt) for fmt in kq.FORMATS)
    block_weights: ClassVar[int] = kq.SUPER_BLOCK
    # One layer may hold row ranges in different served formats (segments of the packed weight).
    mixed_formats: ClassVar[bool] = True

    @classmethod
    def kernel_for(cls, facts: DeviceFacts, act_dtype: torch.dtype) -> str:
        return "kquant_gemm"

    def create_weights(self, layer: LinearBase, out_features: int, in_features: int) -> None:
        super().create_weights(layer, out_features, in_features)
        layer.fmt = 0  # a ggml type id, or the kernel's id for segments; set by finalize
        # (first row, blocks) as loaded, until finalize packs them.
        layer.pieces = []

    def load_rows(self, layer: LinearBase, rows: slice, tensor: CheckpointTensor) -> None:
        if not isinstance(tensor, GGUFBlocks) or tensor.qtype not in self.served_types:
            names = ", ".join(sorted(t.name for t in self.served_types))
            raise ValueError(f"--quantization {self.name} serves {names} tensors as stored, not {describe(tensor)}")
        layer.pieces.append((rows.start or 0, tensor))

    def finalize(self, layer: LinearBase) -> None:
        # Consecutive row ranges of one format make one segment.
        segments: list[tuple[QType, list[torch.Tensor]]] = []
        for _, piece in sorted(layer.pieces, key=lambda p: p[0]):
            if segments and segments[-1][0] == piece.qtype:
                segments[-1][1].append(piece.data)
            else:
                segments.append((piece.qtype, [piece.data]))
        layer.pieces = []
        if len(segments) == 1:  # packed from the file's pieces where they lie
            layer.qtype, layer.fmt = segments[0][0], int(segments[0][0])
            layer.blocks = kq.pack(segments[0][1], layer.fmt)
        else:
            parts = [(torch.cat(data) if len(data) > 1 else data[0], int(qtype)) for qtype, data in segments]
            layer.qtype, layer.fmt = None, kq.MIXED
            layer.blocks = kq.pack_segments(parts)
        layer.formats = "/".join(sorted({qtype.name for qtype, _ in segments}))

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        y = kq.kquant_gemm(x, layer.blocks, layer.fmt, layer.out_features, self.kernel == "kquant_gemm_int8")
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    def native_operands(self, layer: LinearBase) -> tuple[torch.Tensor, int]:
        return layer.blocks, layer.fmt

    def dequantized(self, layer: LinearBase) -> torch.Tensor:
        return kq.unpack(layer.blocks, layer.fmt, layer.out_features, layer.in_features)
