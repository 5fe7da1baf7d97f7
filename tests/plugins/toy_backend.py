"""An ops backend added the way a new one is: this one file and its registration (which declares the name).

The reference ops with attention counted, a layout of its own for the KV cache (keys transposed,
like the native kernels'), and a condition on where it runs, so a test can see the plan ask it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tokenmill_service.worker.kernels.attention_metadata import AttentionMetadata
from tokenmill_service.worker.kernels.attention_params import AttentionParams
from tokenmill_service.worker.kernels.interface import KVCacheLayout, register_ops
from tokenmill_service.worker.kernels.torch_ops import TorchOps

if TYPE_CHECKING:
    from tokenmill_service.worker.device import DeviceFacts

CALLS = {"attention": 0}


@register_ops("toy-transposed", help="the reference ops, attention counted, keys transposed per block")
class CountingOps(TorchOps):
    kv_cache_layout = KVCacheLayout("toy: keys transposed per block", keys_transposed=True)

    @classmethod
    def unavailable_reason(cls, facts: DeviceFacts, act_dtype: torch.dtype, head_dim: int) -> str | None:
        return None if facts.kind == "cpu" else "the toy runs on the CPU only"

    def store_kv(
        self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
    ) -> None:
        # Keys go into [blocks, kv_heads, head_dim, block_size]; values as the reference lays them out.
        block_size = k_cache.shape[-1]
        k_cache[slots // block_size, :, :, slots % block_size] = k.to(k_cache.dtype)
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v.to(v_cache.dtype))

    def attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        params: AttentionParams,
    ) -> torch.Tensor:
        CALLS["attention"] += 1
        return super().attention(q, k_cache.permute(0, 3, 1, 2).contiguous(), v_cache, meta, params)
