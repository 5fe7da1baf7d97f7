"""Linear layers that own their parameters and know where each checkpoint tensor lands.

Shapes follow nano-vllm's ``worker/layers/linear.py``: a layer is built for one tensor-parallel rank;
``load_weight(tensor, shard_id)`` takes a whole checkpoint tensor (dense or GGUF blocks, still
memory-mapped), cuts this rank's part, and hands it to the layer's quantization method:

- ``ReplicatedLinear``: every rank holds it all;
- ``ColumnParallelLinear``: output rows split over ranks (no communication);
- ``MergedColumnParallelLinear``: several column-parallel outputs in one product (gate/up);
- ``QKVParallelLinear``: q, k and v heads in one product; k/v heads are repeated over ranks
  when there are fewer of them than ranks;
- ``RowParallelLinear``: input columns split over ranks, partial sums all-reduced.

A layer may carry LoRA adapter slots (``lora``, set by ``worker/layers/lora/slots.py: attach_lora``): a side
path that adds each adapter token's delta to what the quantization method returned, the base
product untouched.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from tokenmill_service.worker.distributed.parallel import TensorParallel, all_reduce
from tokenmill_service.worker.layers.quant.base import QuantMethod, empty_param
from tokenmill_service.worker.layers.quant.gguf_blocks import CheckpointTensor, GGUFBlocks

if TYPE_CHECKING:
    from gguf import GGMLQuantizationType as QType

    from tokenmill_service.worker.layers.lora.slots import LoRALayer

# Builds the quantization method of the layer named by its prefix ("model.layers.0.mlp.down_proj").
QuantFactory = Callable[[str], QuantMethod]


class LinearBase(nn.Module):
    # Adapter slots beside the weight (None: this layer serves the base only).
    lora: LoRALayer | None = None

    # What the quantization methods keep on the layer (worker/layers/quant/), each method its own few:
    # declared for the type checker only (no class value: the parameters and buffers stay in the
    # module's own tables, found by nn.Module.__getattr__).
    weight: torch.Tensor  # none (native float32 rows, or bfloat16), fp8-block: [out, in]
    weight_t: torch.Tensor  # none (sliced float32 product): [in, out]
    weight_scale: torch.Tensor  # fp8-block: float32 [out, column blocks]
    qweight: torch.Tensor  # int8: [out, in]
    scales: torch.Tensor  # int8: float32 [out]
    kernel_scales: torch.Tensor  # int8: the scales in the kernel's dtype
    qs: torch.Tensor  # int4: GGUF's nibbles [out, groups, 16]
    scale: torch.Tensor  # int4: [out, groups]
    minimum: torch.Tensor  # int4: [out, groups]
    packed: torch.Tensor  # int4: the kernel's opaque layout
    scales_and_zeros: torch.Tensor  # int4: the kernel's [groups, out, 2]
    blocks: torch.Tensor  # gguf, gguf-vnni, gguf-kquant: the file's blocks (or the kernel's layout of them)
    qtype: QType | None  # gguf*: their format (None: not loaded yet; gguf-kquant: several)
    fmt: int  # gguf-kquant: the kernel's format id
    formats: str  # gguf-kquant: the formats held, for reports
    pieces: list[tuple[int, GGUFBlocks]]  # gguf-kquant: (first row, blocks) as loaded, until finalize

    def __init__(self, in_features: int, out_features: int, bias: bool, quant: QuantMethod, tp: TensorParallel) -> None:
        """``in_features`` and ``out_features`` are this rank's."""
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.quant = quant
        self.tp = tp
        quant.create_weights(self, out_features, in_features)
        self.bias = empty_param(out_features, dtype=quant.act_dtype) if bias else None

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` by the layer's method, plus the adapters' deltas where the step uses any."""
        y = self.quant.apply(self, x)
        if self.lora is not None and self.lora.batch.groups:
            y = self.lora.add(x, y)
        return y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.product(x)
        return y if self.bias is None else y + self.bias

    # -- loading ---------------------------------------------------------------------------

    def _pieces(self, shard_id: str | int | None) -> list[tuple[int, int, int]]:
        """(checkpoint row start, row count, local row start) of each part of this rank's rows."""
        return [(0, self.out_features, 0)]

    def _columns(self, tensor: CheckpointTensor) -> CheckpointTensor:
        return tensor

    def load_weight(self, tensor: CheckpointTensor, shard_id: str | int | None = None) -> None:
        tensor = self._columns(tensor)
        for start, count, local in self._pieces(shard_id):
            self.quant.load_rows(self, slice(local, local + count), tensor.narrow(0, start, count))

    def load_bias(self, tensor: torch.Tensor, shard_id: str | int | None = None) -> None:
        assert self.bias is not None, "this layer has no bias"
        for start, count, local in self._pieces(shard_id):
            self.bias.data[local : local + count] = tensor[start : start + count].to(self.bias.dtype)

    def finalize(self) -> None:
        self.quant.finalize(self)


class ReplicatedLinear(LinearBase):
    def __init__(self, in_features: int, out_features: int, bias: bool, quant: QuantMethod) -> None:
        super().__init__(in_features, out_features, bias, quant, TensorParallel())


class ColumnParallelLinear(LinearBase):
    def __init__(self, in_features: int, out_features: int, bias: bool, quant: QuantMethod, tp: TensorParallel) -> None:
        super().__init__(in_features, tp.split(out_features, "output features"), bias, quant, tp)

    def _pieces(self, shard_id: str | int | None) -> list[tuple[int, int, int]]:
        return [(self.tp.rank * self.out_features, self.out_features, 0)]


class MergedColumnParallelLinear(LinearBase):
    """Several outputs of the same input (gate and up), each split over ranks, packed side by side."""

    def __init__(
        self, in_features: int, output_sizes: list[int], bias: bool, quant: QuantMethod, tp: TensorParallel
    ) -> None:
        self.local_sizes = [tp.split(n, "output features") for n in output_sizes]
        super().__init__(in_features, sum(self.local_sizes), bias, quant, tp)

    def _pieces(self, shard_id: str | int | None) -> list[tuple[int, int, int]]:
        assert isinstance(shard_id, int)
        local = sum(self.local_sizes[:shard_id])
        size = self.local_sizes[shard_id]
        return [(self.tp.rank * size, size, local)]


class QKVParallelLinear(LinearBase):
    """q, k and v in one product; heads split over ranks, k/v heads repeated when fewer than ranks."""

    def __init__(
        self,
        hidden: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        quant: QuantMethod,
        tp: TensorParallel,
    ) -> None:
        self.head_dim = head_dim
        self.num_heads = tp.split(num_heads, "attention heads")
        if num_kv_heads >= tp.size:
            self.num_kv_heads = tp.split(num_kv_heads, "key/value heads")
            self.kv_head_start = tp.rank * self.num_kv_heads
        else:
            if tp.size % num_kv_heads:
                raise ValueError(
                    f"the tensor-parallel degree {tp.size} must be a multiple of the key/value heads ({num_kv_heads})"
                )
            self.num_kv_heads = 1
            self.kv_head_start = tp.rank * num_kv_heads // tp.size
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        super().__init__(hidden, self.q_size + 2 * self.kv_size, bias, quant, tp)

    def _pieces(self, shard_id: str | int | None) -> list[tuple[int, int, int]]:
        if shard_id == "q":
            return [(self.tp.rank * self.q_size, self.q_size, 0)]
        local = self.q_size if shard_id == "k" else self.q_size + self.kv_size
        return [(self.kv_head_start * self.head_dim, self.kv_size, local)]


class RowParallelLinear(LinearBase):
    """Input columns split over ranks; each rank's partial product is summed by an all-reduce."""

    def __init__(self, in_features: int, out_features: int, bias: bool, quant: QuantMethod, tp: TensorParallel) -> None:
        super().__init__(tp.split(in_features, "input features"), out_features, bias, quant, tp)

    def _columns(self, tensor: CheckpointTensor) -> CheckpointTensor:
        if self.tp.size == 1:
            return tensor
        return tensor.narrow(1, self.tp.rank * self.in_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = all_reduce(self.product(x), self.tp)
        return y if self.bias is None else y + self.bias
