"""The torch backend on a CPU, with its operations in tokenmill's native kernels (native/).

Attention is native/paged_attention.cpp; RMSNorm with the residual add, rotary and SiLU-and-mul are
native/elementwise.cpp, one pass each instead of several torch operations. The loader picks this
class for ``--backend torch`` where the kernels can run (a CPU, float32 activations and KV cache,
head_dim 64 or 128, the kernels built); anything else (another layout or dtype) goes to the
reference (``TorchOps``), as does code being compiled (inductor fuses it). Every kernel computes each row or query on its own in a fixed order, so
the batch-invariance promises hold by construction; tests/test_native_ops.py holds them to the
reference's results.
"""

from __future__ import annotations

import torch

from tokenmill_service.native import elementwise, paged_attention
from tokenmill_service.ops.attention_metadata import AttentionMetadata
from tokenmill_service.ops.torch_ops import TorchOps


def native_attention_serves(device: str | torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """None when the native attention kernel can serve this model here; otherwise why not."""
    if torch.device(device).type != "cpu":
        return f"it runs on the CPU, and this model is on {device}"
    if dtype != torch.float32:
        return f"it takes float32 activations, and these are {str(dtype).removeprefix('torch.')}"
    if head_dim not in paged_attention.HEAD_DIMS:
        return f"it takes head_dim 64 or 128, and this model's is {head_dim}"
    return paged_attention.unavailable_reason() or elementwise.unavailable_reason()


def _eager() -> bool:
    """Under torch.compile (--compile auto) the elementwise work is inductor's to fuse: the reference."""
    return not torch.compiler.is_compiling()


class NativeCpuOps(TorchOps):
    def rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None,
        out_dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if (
            _eager()
            and out_dtype == torch.float32
            and x.dim() == 2
            and elementwise.fits(x, weight, *([residual] if residual is not None else []))
        ):
            return elementwise.rms_norm(x, weight, eps, residual)
        return super().rms_norm(x, weight, eps, residual, out_dtype)

    def rotary(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if _eager() and elementwise.fits(q, k, cos, sin) and all(x.stride(1) == x.shape[2] for x in (q, k)):
            return elementwise.rotary_(q, positions, cos, sin), elementwise.rotary_(k, positions, cos, sin)
        return super().rotary(q, k, positions, cos, sin)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        if _eager() and elementwise.fits(x):
            return elementwise.silu_and_mul(x)
        return super().silu_and_mul(x)

    def store_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Keys into the native kernel's transposed layout; values as the reference lays them out."""
        paged_attention.store_keys(k.float(), k_cache, slot_mapping)
        paged_attention.store_values(v.float(), v_cache, slot_mapping)

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
