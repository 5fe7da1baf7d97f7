"""The token embedding and the output head, split over the vocabulary for tensor parallelism.

Each rank holds a contiguous slice of the vocabulary. The embedding looks up the ids that fall
in its slice (zeros elsewhere) and the slices are summed; the head computes its slice of the
logits, which are gathered.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill_service.distributed.parallel import TensorParallel, all_gather_last_dim, all_reduce
from tokenmill_service.layers.linear import ColumnParallelLinear
from tokenmill_service.layers.quant.base import QuantMethod, empty_param
from tokenmill_service.layers.quant.gguf_blocks import CheckpointTensor, dense


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden: int, dtype: torch.dtype, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_local = tp.split(vocab_size, "vocabulary size")
        self.start = tp.rank * self.vocab_local
        self.weight = empty_param(self.vocab_local, hidden, dtype=dtype)

    def load_weight(self, tensor: CheckpointTensor, shard_id: None = None) -> None:
        self.weight.data.copy_(dense(tensor.narrow(0, self.start, self.vocab_local)).to(self.weight.dtype))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.vocab_local)
        x = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside[:, None], 0)
        return all_reduce(x, self.tp)


class ParallelLMHead(ColumnParallelLinear):
    """Logits [T, vocab] in float32: each rank's vocabulary slice, gathered."""

    def __init__(self, hidden: int, vocab_size: int, quant: QuantMethod, tp: TensorParallel) -> None:
        super().__init__(hidden, vocab_size, False, quant, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_gather_last_dim(self.quant.apply(self, x).float(), self.tp)
