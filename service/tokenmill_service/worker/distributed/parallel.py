"""Which shard of the model this process holds, and the collectives that join the shards.

A replica is a torch.distributed group of ``size`` ranks. Layers are built for one rank
(``TensorParallel``) and call ``all_reduce`` / ``all_gather`` here; with one rank both are
identities, so the single-device path runs no collective at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    # Mixture-of-experts layers give each rank whole experts (experts / size of them) instead of a
    # slice of every expert (worker/layers/fused_moe/layer.py); attention and dense layers split as ever.
    expert_parallel: bool = False

    @classmethod
    def current(cls) -> TensorParallel:
        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size())
        return cls()

    def split(self, total: int, what: str) -> int:
        """This rank's share of ``total`` (an even split, or a clear error)."""
        if total % self.size:
            raise ValueError(f"{what} ({total}) is not divisible by the tensor-parallel degree {self.size}")
        return total // self.size


def all_reduce(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    if tp.size > 1:
        dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Concatenate every rank's ``x`` along the last dimension (rank order)."""
    if tp.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(tp.size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)
