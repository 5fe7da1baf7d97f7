"""RMSNorm with the residual add fused in; the residual stream stays float32 between layers."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill_service.worker.kernels.interface import Ops
from tokenmill_service.worker.layers.quant.gguf_blocks import CheckpointTensor, dense


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, ops: Ops, out_dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.ops = ops
        self.out_dtype = out_dtype
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)  # float32 whatever the model dtype

    def load_weight(self, tensor: CheckpointTensor, shard_id: None = None) -> None:
        self.weight.data.copy_(dense(tensor).float())

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed x + residual in the model's dtype, x + residual in float32)."""
        return self.ops.rms_norm(x, self.weight, self.eps, residual, self.out_dtype)
