"""The triton backend: the hot operations as Triton kernels, one file each, tested against kernels/torch_ops.py.

Selected with ``--backend triton``. On a GPU the kernels are compiled; with ``TRITON_INTERPRET=1``
they run in Triton's interpreter on the CPU (slow; for tests), where the model runs float32 and ``tl.dot``
is interpreter.py's: each element of a product the same wherever it lies in the tile, as on a GPU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import structlog
import torch

from tokenmill_service.worker.device import interpreter_enabled
from tokenmill_service.worker.kernels import latent_attention as reference_latent
from tokenmill_service.worker.kernels.attention_metadata import AttentionMetadata
from tokenmill_service.worker.kernels.attention_params import AttentionParams, LatentAttentionParams, LatentCache
from tokenmill_service.worker.kernels.interface import LatentCacheLayout, LoRADelta, Ops, register_ops
from tokenmill_service.worker.kernels.triton import interpreter
from tokenmill_service.worker.kernels.triton import lora as triton_lora
from tokenmill_service.worker.kernels.triton.attention import paged_attention
from tokenmill_service.worker.kernels.triton.latent_attention import latent_attention
from tokenmill_service.worker.kernels.triton.rms_norm import rms_norm
from tokenmill_service.worker.kernels.triton.rotary import rotary
from tokenmill_service.worker.kernels.triton.silu_and_mul import silu_and_mul
from tokenmill_service.worker.kernels.triton.store_kv import store_kv

if TYPE_CHECKING:
    from tokenmill_service.worker.device import DeviceFacts

log = structlog.get_logger(__name__)

if interpreter_enabled() and not interpreter.install():
    log.warning(
        "triton_interpreter_dot",
        message="this Triton's interpreter has no create_dot to replace: its tl.dot is the host BLAS's, whose rows "
        "may depend on their place in a tile (OpenBLAS's AVX2 kernels), so results may vary with the batch",
    )


@register_ops("triton")
class TritonOps(Ops):
    # The reference's latent cache: the plain-torch store writes it, the triton kernel reads it.
    latent_cache_layout = LatentCacheLayout()

    @classmethod
    def lora_delta(cls) -> LoRADelta:
        return triton_lora.lora_delta

    @classmethod
    def unavailable_reason(cls, facts: DeviceFacts, act_dtype: torch.dtype, head_dim: int) -> str | None:
        if facts.triton_missing is not None:
            return facts.triton_missing
        if facts.triton_interpreter and act_dtype != torch.float32:
            return "Triton's interpreter runs float32 only"
        return None

    def __init__(self) -> None:
        if interpreter_enabled():
            log.warning(
                "triton_interpreter",
                message="TRITON_INTERPRET=1: the triton kernels run in Triton's CPU interpreter, slowly, in float32; "
                "for testing only",
            )

    def rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None,
        out_dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return rms_norm(x, weight, eps, residual, out_dtype)

    def rotary(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary(q, k, positions, cos, sin)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)

    def store_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        store_kv(k, v, k_cache, v_cache, slot_mapping)

    def attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        params: AttentionParams,
    ) -> torch.Tensor:
        return paged_attention(q, k_cache, v_cache, meta, params)

    def store_latent(
        self, latent: torch.Tensor, k_rope: torch.Tensor, cache: LatentCache, slot_mapping: torch.Tensor
    ) -> None:
        reference_latent.store_latent(latent, k_rope, cache, slot_mapping)

    def latent_attention(
        self,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        cache: LatentCache,
        meta: AttentionMetadata,
        params: LatentAttentionParams,
    ) -> torch.Tensor:
        return latent_attention(q_nope, q_rope, cache, meta, params)
