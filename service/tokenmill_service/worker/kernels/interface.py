"""The hot operations of a decoder, one implementation per backend, the same signatures for all.

The model calls these and nothing else for its arithmetic outside the linear layers. The torch
implementation (``torch_ops.py``) is the reference; a faster backend (native CPU kernels, triton)
registers its own class under its name, says where it can run (``unavailable_reason``) and how it
lays out the KV cache (``kv_cache_layout``), and is tested against the reference on random inputs.
The load plan (worker/plan/resolve.py) asks these; nothing else decides which backend runs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F

from tokenmill_service.contract.plan import choices
from tokenmill_service.worker.kernels import moe_routing
from tokenmill_service.worker.kernels.attention_metadata import AttentionMetadata
from tokenmill_service.worker.kernels.attention_params import AttentionParams, LatentAttentionParams, LatentCache
from tokenmill_service.worker.kernels.moe_routing import GroupedTopK
from tokenmill_service.worker.registry import Registry

if TYPE_CHECKING:
    from tokenmill_service.worker.device import DeviceFacts
    from tokenmill_service.worker.kernels.cpu.moe_mlp import NativeExperts


@dataclass(frozen=True, slots=True)
class LoRAStack:
    """One linear layer's adapter slots, as LoRA's grouped product reads them: ``a`` [slots, P, R, in] for its
    P projections (3 for a packed q/k/v), ``bt`` [slots, R, out] (B transposed, the scale folded in; float32 or
    bfloat16), ``ranks`` int64 [slots, P] (the rows of each block of A a slot's adapter fills; 0: that
    projection not targeted), ``parts`` each projection's output columns (start, count). The layer writes
    adapters into the tensors in place (worker/layers/lora/slots.py)."""

    a: torch.Tensor
    bt: torch.Tensor
    ranks: torch.Tensor
    parts: list[tuple[int, int]]


# LoRA's grouped product: (x, stack, groups) -> for each (slot, token rows) group, (rows, the float32 delta of
# those rows [n, out]): worker/layers/lora/sgmv.py's ``lora_delta`` or a backend's own (triton/lora.py's).
LoRADelta = Callable[[torch.Tensor, LoRAStack, list[tuple[int, torch.Tensor]]], list[tuple[torch.Tensor, torch.Tensor]]]


@dataclass(frozen=True, slots=True)
class KVCacheLayout:
    """How a backend lays out one layer's cache: values always [blocks, block_size, kv_heads,
    head_dim]; keys that, or each block transposed to [kv_heads, head_dim, block_size]
    (``keys_transposed``: what a kernel that scores a query against many keys at once reads)."""

    name: str = "blocks"
    keys_transposed: bool = False

    def shapes(
        self, layers: int, blocks: int, block_size: int, kv_heads: int, head_dim: int
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The (key, value) cache shapes of a model: [layers, blocks, ...] each."""
        values = (layers, blocks, block_size, kv_heads, head_dim)
        keys = (layers, blocks, kv_heads, head_dim, block_size) if self.keys_transposed else values
        return keys, values


@dataclass(frozen=True, slots=True)
class LatentCacheLayout:
    """How a backend lays out one layer's cache for multi-head latent attention (DeepSeek-V2/V3), where a
    token caches one compressed latent shared by every head and one rotary key, not keys and values
    per head: the "key" tensor holds the latents [blocks, block_size, 1, latent_dim], the "value"
    tensor the rotary keys [blocks, block_size, 1, rope_dim] (so ``AttentionMetadata`` and the
    runner carry them as they carry any cache)."""

    name: str = "latent blocks"

    def shapes(
        self, layers: int, blocks: int, block_size: int, latent_dim: int, rope_dim: int
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The (latent, rotary key) cache shapes of a model: [layers, blocks, ...] each."""
        return (layers, blocks, block_size, 1, latent_dim), (layers, blocks, block_size, 1, rope_dim)


class Ops(ABC):
    name: ClassVar[str]
    # What the KV cache may store besides the activations' dtype (the native kernel reads float16).
    kv_cache_dtypes: ClassVar[tuple[torch.dtype, ...]] = ()
    # Plain torch operations that torch.compile can trace (the reference and what derives from it).
    compilable: ClassVar[bool] = False
    kv_cache_layout: ClassVar[KVCacheLayout] = KVCacheLayout()
    # The latent cache of multi-head latent attention, where the backend serves it (None: it does not).
    latent_cache_layout: ClassVar[LatentCacheLayout | None] = None

    @classmethod
    def unavailable_reason(cls, facts: DeviceFacts, act_dtype: torch.dtype, head_dim: int) -> str | None:
        """None where this backend can run a model of ``head_dim`` at ``act_dtype`` on the device of
        ``facts``; otherwise why not (the plan reports it)."""
        return None

    @classmethod
    def lora_delta(cls) -> LoRADelta | None:
        """LoRA's grouped product, where the backend has its own (worker/layers/lora/sgmv.py's ``lora_delta``'s
        signature); None: the layers' own."""
        return None

    @abstractmethod
    def rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None,
        out_dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """h = x + residual (or x alone), in float32; returns (rmsnorm(h) * weight as out_dtype, h).

        x: [T, D] any float dtype; residual: [T, D] float32 or None; weight: [D] float32.
        """

    @abstractmethod
    def rotary(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate the two halves of every head (Hugging Face's layout); computed in float32.

        q: [T, H, D], k: [T, KV, D] (may be strided views); positions: [T] int64;
        cos, sin: [max_positions, D // 2] float32. Returns q and k rotated, in their dtype
        (an implementation may rotate in place and return its inputs).
        """

    @abstractmethod
    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, 2 * I] (gate, up) -> silu(gate) * up: [T, I], computed in float32, in x's dtype."""

    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, 2 * I] (gate, up) -> gelu(gate, tanh approximation) * up: [T, I], computed in
        float32, in x's dtype (Gemma's GeGLU). Elementwise plain torch for every backend."""
        gate, up = x.float().chunk(2, dim=-1)
        return (F.gelu(gate, approximate="tanh") * up).to(x.dtype)

    def clamped_swiglu_and_mul(self, x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
        """x: [T, 2 * I] (gate, up) -> [T, I]: gpt-oss's experts' activation, in float32, in x's dtype:
        gate clamped above at ``limit``, up to [-limit, limit], then gate * sigmoid(alpha * gate) *
        (up + 1). Elementwise plain torch for every backend."""
        gate, up = x.float().chunk(2, dim=-1)
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (gate * torch.sigmoid(gate * alpha) * (up + 1)).to(x.dtype)

    def select_experts(self, logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """A mixture-of-experts router's choice: logits [T, experts] -> (weights float32, expert ids int64)
        [T, top_k] by rank, softmax top-k renormalized where asked (worker/kernels/moe_routing.py)."""
        return moe_routing.select_experts(logits, top_k, renormalize)

    def select_top_logits(self, logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """gpt-oss's router choice: logits [T, experts] -> (weights float32, expert ids int64) [T, top_k] by
        rank, the top_k logits softmaxed over the chosen (worker/kernels/moe_routing.py)."""
        return moe_routing.select_top_logits(logits, top_k)

    def select_experts_grouped(
        self, logits: torch.Tensor, score_bias: torch.Tensor, top_k: int, renormalize: bool, routing: GroupedTopK
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """DeepSeek-V3's router choice: logits [T, experts] and the score-correction bias [experts] ->
        (weights float32, expert ids int64) [T, top_k] by rank, group-limited sigmoid routing
        (worker/kernels/moe_routing.py's ``select_experts_grouped``)."""
        return moe_routing.select_experts_grouped(logits, score_bias, top_k, renormalize, routing)

    def moe_experts(
        self, experts: NativeExperts, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        """A mixture-of-experts layer's held experts (their packed weights, formats and biases) on x
        [T, hidden] float32 for the router's weights and expert ids [T, top_k] (by rank) in one call:
        float32 [T, hidden], each token's weighted sum in its ranks' order. Only a backend the load plan
        runs the experts in one call with has it (``LoadPlan.experts``); elsewhere the layer loops."""
        raise NotImplementedError(f"the {self.name} ops have no experts call")

    @abstractmethod
    def store_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Write this step's keys and values [T, KV, D] into their slots of one layer's cache
        ([num_blocks, block_size, KV, D]); cast to the cache's dtype."""

    @abstractmethod
    def attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        params: AttentionParams,
    ) -> torch.Tensor:
        """Causal attention of each new token over its sequence's cached keys and values
        (this step's already stored), as the layer's ``params`` say (scale, window, soft cap, sinks).
        q: [T, H, D] -> [T, H, D] in q's dtype; float32 inside. A query at position p sees positions
        0..p of its own sequence, or only the last ``params.window`` of them."""

    def store_latent(
        self, latent: torch.Tensor, k_rope: torch.Tensor, cache: LatentCache, slot_mapping: torch.Tensor
    ) -> None:
        """Write this step's latents [T, L] and rotary keys [T, R] into their slots of one layer's
        latent cache (``latent_cache_layout``); cast to the cache's dtype."""
        raise NotImplementedError(f"the {self.name} ops have no latent attention")

    def latent_attention(
        self,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        cache: LatentCache,
        meta: AttentionMetadata,
        params: LatentAttentionParams,
    ) -> torch.Tensor:
        """Multi-head latent attention in the absorbed form, causal over each sequence's cached latents
        (this step's already stored). q_nope: [T, H, N], q_rope: [T, H, R] (rotated). Head h of a query
        scores the key at position j as ``(q_nope[h] @ w_uk[h]) . latent[j] + q_rope[h] . k_rope[j]`` times
        ``params.scale``, and returns ``(softmax-weighted latents) @ w_uv[h]``: [T, H, V] in q_nope's dtype;
        float32 inside."""
        raise NotImplementedError(f"the {self.name} ops have no latent attention")


_BACKENDS: Registry[type[Ops]] = Registry("backend", choices.BACKEND)

# Class decorator: make an Ops implementation selectable as ``--backend name``.
register_ops = _BACKENDS.register


def ops_class(name: str) -> type[Ops]:
    """The backend registered as ``name`` (ValueError naming the registered ones otherwise)."""
    if name == "triton" and name not in _BACKENDS:
        import tokenmill_service.worker.kernels.triton  # noqa: F401 - registers itself; imported only when asked for
    return _BACKENDS.get(name)


def get_ops(name: str) -> Ops:
    return ops_class(name)()


def available_backends() -> list[str]:
    return _BACKENDS.names()
