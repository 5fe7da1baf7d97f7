"""Rotary position embeddings: the cos/sin tables (Llama 3 scaling included); the rotation is an op."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from tokenmill_service.worker.kernels.interface import Ops


@dataclass(slots=True)
class RopeScaling:
    """Llama 3 style frequency-dependent RoPE scaling ("rope_type": "llama3")."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return inv_freq.float()
    factor, low, high = scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor
    original = scaling.original_max_position_embeddings
    # Llama 3: long wavelengths are slowed by `factor`, short ones kept, a smooth blend between.
    low_freq_wavelen, high_freq_wavelen = original / low, original / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled).float()


class RotaryEmbedding(nn.Module):
    """Rotates the two halves of each head (Hugging Face layout, not interleaved pairs)."""

    cos: torch.Tensor  # [max_positions, head_dim // 2] buffers
    sin: torch.Tensor

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: RopeScaling | None, ops: Ops) -> None:
        super().__init__()
        self.ops = ops
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), rope_inv_freq(head_dim, theta, scaling))
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ops.rotary(q, k, positions, self.cos, self.sin)
