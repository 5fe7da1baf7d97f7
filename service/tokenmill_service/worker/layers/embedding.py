"""The token embedding and the output head, split over the vocabulary for tensor parallelism.

Each rank holds a contiguous slice of the vocabulary. The embedding looks up the ids that fall
in its slice (zeros elsewhere) and the slices are summed; the head computes its slice of the
logits, which are gathered.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill_service.worker.distributed.parallel import TensorParallel, all_gather_last_dim, all_reduce
from tokenmill_service.worker.layers.linear import ColumnParallelLinear
from tokenmill_service.worker.layers.quant.base import QuantMethod, empty_param
from tokenmill_service.worker.layers.quant.gguf_blocks import CheckpointTensor, GGUFBlocks, dense


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden: int, dtype: torch.dtype, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_local = tp.split(vocab_size, "vocabulary size")
        self.start = tp.rank * self.vocab_local
        self.weight = empty_param(self.vocab_local, hidden, dtype=dtype)
        # Set by the builder where the plan keeps a GGUF's table as stored ("gguf-blocks"): the file's
        # rows (a view of the memory-mapped file, never copied), only the looked-up rows dequantized,
        # exactly as gguf does, so the values are those of the float32 table at the file's size.
        self.keep_blocks = False
        self.blocks: GGUFBlocks | None = None

    def load_weight(self, tensor: CheckpointTensor, shard_id: None = None) -> None:
        local = tensor.narrow(0, self.start, self.vocab_local)
        if self.keep_blocks and isinstance(local, GGUFBlocks):
            self.blocks = local
            self.weight = empty_param(0, self.weight.shape[1], dtype=torch.float32)
            return
        self.weight.data.copy_(dense(local).to(self.weight.dtype))

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self.blocks is None:
            return F.embedding(ids, self.weight)
        return self.blocks.rows(ids.cpu()).dequantize().to(ids.device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self._rows(ids)
        local = ids - self.start
        outside = (local < 0) | (local >= self.vocab_local)
        x = self._rows(local.masked_fill(outside, 0)).masked_fill(outside[:, None], 0)
        return all_reduce(x, self.tp)


class ParallelLMHead(ColumnParallelLinear):
    """Logits [T, vocab] in float32: each rank's vocabulary slice, gathered."""

    def __init__(self, hidden: int, vocab_size: int, quant: QuantMethod, tp: TensorParallel) -> None:
        super().__init__(hidden, vocab_size, False, quant, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_gather_last_dim(self.quant.apply(self, x).float(), self.tp)
