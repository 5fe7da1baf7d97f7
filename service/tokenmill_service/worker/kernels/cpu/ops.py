"""The ``native`` backend: the torch backend's operations in tokenmill's native CPU kernels (native/).

Attention is worker/kernels/cpu/paged_attention.cpp; RMSNorm with the residual add, rotary, SiLU-and-mul,
Gemma's GeGLU and gpt-oss's clamped SwiGLU are worker/kernels/cpu/elementwise.cpp, one pass each instead of
several torch operations. The load plan picks it for ``--backend torch`` where it can run
(``unavailable_reason``: a CPU, float32 activations, head_dim 64, 128 or 256, the kernels built); it
lays its key cache out transposed per block (``kv_cache_layout``) and can store the cache in float16.
Tensors it has no kernel for (another dtype or stride) go to the reference (``TorchOps``), as does
code being compiled (inductor fuses it). Multi-head latent attention (DeepSeek's) is worker/kernels/cpu/latent_attention.cpp, over the
reference's latent cache layout (which the reference's ``store_latent`` writes). Every kernel
computes each row or query on its own in a fixed order, so the batch-invariance promises hold by
construction; tests/kernels/test_native_ops.py and test_native_latent_attention.py hold them to the
reference's results.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tokenmill_service.worker.kernels.attention_metadata import AttentionMetadata
from tokenmill_service.worker.kernels.attention_params import AttentionParams, LatentAttentionParams, LatentCache
from tokenmill_service.worker.kernels.cpu import elementwise, latent_attention, moe_mlp, paged_attention
from tokenmill_service.worker.kernels.interface import KVCacheLayout, register_ops
from tokenmill_service.worker.kernels.torch_ops import TorchOps

if TYPE_CHECKING:
    from tokenmill_service.worker.device import DeviceFacts
    from tokenmill_service.worker.kernels.moe_routing import GroupedTopK


def _eager() -> bool:
    """Under torch.compile (--compile auto) the elementwise work is inductor's to fuse: the reference."""
    return not torch.compiler.is_compiling()


def _routable(logits: torch.Tensor) -> bool:
    """moe_mlp.cpp's router takes these logits (float32 [T, experts] on the CPU, eager, the kernel built)."""
    return (
        _eager()
        and logits.dtype == torch.float32
        and logits.dim() == 2
        and logits.device.type == "cpu"
        and moe_mlp.unavailable_reason() is None
    )


@register_ops("native")
class NativeCpuOps(TorchOps):
    kv_cache_dtypes = (torch.float16,)
    compilable = True  # attention runs eager between compiled regions; inside them, the reference's ops
    kv_cache_layout = KVCacheLayout("blocks, keys transposed per block", keys_transposed=True)

    @classmethod
    def unavailable_reason(cls, facts: DeviceFacts, act_dtype: torch.dtype, head_dim: int) -> str | None:
        if facts.kind != "cpu":
            return f"it runs on the CPU, and this model is on {facts.device}"
        if act_dtype != torch.float32:
            return f"it takes float32 activations, and these are {str(act_dtype).removeprefix('torch.')}"
        if head_dim not in paged_attention.HEAD_DIMS:
            return f"it takes head_dim 64, 128 or 256, and this model's is {head_dim}"
        return facts.native("paged_attention", "elementwise")

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
        # (whole heads, or the first dims of each: partial rotary's views, heads further apart)
        if _eager() and elementwise.fits(q, k, cos, sin) and all(x.stride(1) >= x.shape[2] for x in (q, k)):
            return elementwise.rotary_(q, positions, cos, sin), elementwise.rotary_(k, positions, cos, sin)
        return super().rotary(q, k, positions, cos, sin)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        if _eager() and elementwise.fits(x):
            return elementwise.silu_and_mul(x)
        return super().silu_and_mul(x)

    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """elementwise.cpp's GeGLU, the one the native decoder stack calls: so the eager loop's bits."""
        if _eager() and x.dim() == 2 and elementwise.fits(x):
            return elementwise.gelu_tanh_and_mul(x)
        return super().gelu_tanh_and_mul(x)

    def clamped_swiglu_and_mul(self, x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
        """elementwise.cpp's, the one the native experts call (moe_mlp.cpp) computes: so the experts
        one by one and in one call give the same bits."""
        if _eager() and x.dim() == 2 and elementwise.fits(x):
            return elementwise.clamped_swiglu_and_mul(x, alpha, limit)
        return super().clamped_swiglu_and_mul(x, alpha, limit)

    def select_experts(self, logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """moe_mlp.cpp's softmax top-k (the one the native decoder stack calls, so its choice and bits;
        ties ranked as torch.topk ranks them)."""
        if _routable(logits):
            return moe_mlp.route(logits, top_k, "renormalized" if renormalize else "softmax")
        return super().select_experts(logits, top_k, renormalize)

    def select_top_logits(self, logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """moe_mlp.cpp's top-k logits softmaxed (gpt-oss's; the native decoder stack's choice and bits)."""
        if _routable(logits):
            return moe_mlp.route(logits, top_k, "top_logits")
        return super().select_top_logits(logits, top_k)

    def select_experts_grouped(
        self, logits: torch.Tensor, score_bias: torch.Tensor, top_k: int, renormalize: bool, routing: GroupedTopK
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """moe_mlp.cpp's group-limited sigmoid routing (DeepSeek-V3's; the native decoder stack's choice and
        bits)."""
        if _routable(logits) and score_bias.dtype == torch.float32:
            return moe_mlp.route_grouped(logits, score_bias, top_k, renormalize, routing)
        return super().select_experts_grouped(logits, score_bias, top_k, renormalize, routing)

    def moe_experts(
        self, experts: moe_mlp.NativeExperts, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        """One native call for the layer's experts (worker/kernels/cpu/moe_mlp.cpp): the loop's kernels, rows and
        order, so its bits."""
        return experts(x, weights, ids)

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
        params: AttentionParams,
    ) -> torch.Tensor:
        return paged_attention.paged_attention(
            q.float(),
            k_cache,
            v_cache,
            meta.positions,
            meta.seq_of_token,
            meta.block_tables,
            params.scale,
            params.window,
            params.softcap,
            params.sinks,
        ).to(q.dtype)

    def store_latent(
        self, latent: torch.Tensor, k_rope: torch.Tensor, cache: LatentCache, slot_mapping: torch.Tensor
    ) -> None:
        """paged_attention.cpp's value store, row by row (the native decoder stack's: so its bits in a
        float16 cache); the reference's where the rows are not float32."""
        if latent.dtype != torch.float32 or k_rope.dtype != torch.float32:
            return super().store_latent(latent, k_rope, cache, slot_mapping)
        for rows, stored in ((latent, cache.latents), (k_rope, cache.rope_keys)):
            t, d = rows.shape
            view = rows if rows.stride(-1) == 1 else rows.contiguous()
            paged_attention.store_values(view.as_strided((t, 1, d), (view.stride(0), d, 1)), stored, slot_mapping)

    def latent_attention(
        self,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        cache: LatentCache,
        meta: AttentionMetadata,
        params: LatentAttentionParams,
    ) -> torch.Tensor:
        if _eager() and latent_attention.fits(q_nope, q_rope, cache, params):
            out = latent_attention.latent_attention(
                q_nope, q_rope, cache, params, meta.positions, meta.seq_of_token, meta.block_tables
            )
            return out.to(q_nope.dtype)
        return super().latent_attention(q_nope, q_rope, cache, meta, params)
