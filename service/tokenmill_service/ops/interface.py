"""The hot operations of a decoder, one implementation per backend, the same signatures for all.

The model calls these and nothing else for its arithmetic outside the linear layers. The torch
implementation (``torch_ops.py``) is the reference; a faster backend (triton) registers its own
class under its name and is tested against the reference on random inputs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from tokenmill_service.ops.attention_metadata import AttentionMetadata
from tokenmill_service.registry import Registry


class Ops(ABC):
    name: ClassVar[str]

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
        scale: float,
    ) -> torch.Tensor:
        """Causal attention of each new token over its sequence's cached keys and values
        (this step's already stored). q: [T, H, D] -> [T, H, D] in q's dtype; float32 inside.
        A query at position p sees positions 0..p of its own sequence."""


_BACKENDS: Registry[type[Ops]] = Registry("backend")

# Class decorator: make an Ops implementation selectable as ``--backend name``.
register_ops = _BACKENDS.register


def get_ops(name: str) -> Ops:
    if name == "triton" and name not in _BACKENDS:
        import tokenmill_service.ops.triton  # noqa: F401 - registers itself; imported only when asked for
    return _BACKENDS.get(name)()


def available_backends() -> list[str]:
    return _BACKENDS.names()
