"""``LayerParams``: what a decoder layer, its attention and its feed-forward block are built from.

One typed argument, the same for every family's layers (a family's attention takes it whole, and its
layer hands it on with the sub-module's prefix: ``params.under("self_attn")``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from tokenmill_service.worker.distributed.parallel import TensorParallel
from tokenmill_service.worker.kernels.interface import Ops
from tokenmill_service.worker.layers.linear import QuantFactory
from tokenmill_service.worker.layers.rotary import RotaryEmbedding
from tokenmill_service.worker.models.config import ModelConfig


@dataclass(frozen=True, slots=True)
class LayerParams:
    config: ModelConfig
    prefix: str  # the module's checkpoint prefix: "model.layers.3", "model.layers.3.self_attn", ...
    layer_idx: int  # its layer in the KV cache
    rotary: RotaryEmbedding  # the tables the decoder's layers share (a layer may build its own)
    ops: Ops
    quant: QuantFactory
    tp: TensorParallel
    act_dtype: torch.dtype  # what the norms hand the linear layers

    def under(self, name: str) -> LayerParams:
        """The same, for the sub-module ``name`` (its prefix extended)."""
        return dataclasses.replace(self, prefix=f"{self.prefix}.{name}")
