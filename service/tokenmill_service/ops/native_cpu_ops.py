"""The torch backend on a CPU, with attention in tokenmill's native kernel (native/paged_attention.cpp).

Everything else is the reference (``TorchOps``). The loader picks this class for ``--backend torch``
where the kernel can run (a CPU, a float32 KV cache, head_dim 64 or 128, the kernel built); the
kernel computes each query on its own in a fixed order, so the batch-invariance promises hold by
construction, and tests/test_native_attention.py holds it to the reference's results.
"""

from __future__ import annotations

import torch

from tokenmill_service.native import paged_attention
from tokenmill_service.ops.attention_metadata import AttentionMetadata
from tokenmill_service.ops.torch_ops import TorchOps


def native_attention_serves(device: str | torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """None when the native attention kernel can serve this model here; otherwise why not."""
    if torch.device(device).type != "cpu":
        return f"it runs on the CPU, and this model is on {device}"
    if dtype != torch.float32:
        return f"it reads a float32 KV cache, and the activations are {str(dtype).removeprefix('torch.')}"
    if head_dim not in paged_attention.HEAD_DIMS:
        return f"it takes head_dim 64 or 128, and this model's is {head_dim}"
    return paged_attention.unavailable_reason()


class NativeCpuOps(TorchOps):
    def attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        return paged_attention.paged_attention(
            q.float(), k_cache, v_cache, meta.positions, meta.seq_of_token, meta.block_tables, scale
        ).to(q.dtype)
