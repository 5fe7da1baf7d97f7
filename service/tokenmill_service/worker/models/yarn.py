"""YaRN (transformers' ``_compute_yarn_parameters``): the rotary frequencies of a context stretched past
the one a model was trained on, and the attention-scale corrections that go with them (DeepSeek-V3's,
gpt-oss's)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from tokenmill_service.worker.models.config import ModelConfig

YARN_TYPES = frozenset({"yarn", "deepseek_yarn"})


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True, slots=True)
class Yarn:
    """YaRN's parameters as transformers' ``_compute_yarn_parameters`` reads them."""

    factor: float
    original_max_positions: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True

    def inv_freq(self, dim: int, theta: float) -> torch.Tensor:
        def correction_dim(rotations: float) -> float:
            return (dim * math.log(self.original_max_positions / (rotations * 2 * math.pi))) / (2 * math.log(theta))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
        extrapolation = 1 - ramp
        return (1.0 / (self.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation

    @property
    def cos_sin_factor(self) -> float:
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

    @property
    def softmax_factor(self) -> float:
        """DeepSeek's correction of the softmax scale (transformers' ``yarn_apply_mscale``)."""
        return yarn_mscale(self.factor, self.mscale_all_dim) ** 2 if self.mscale_all_dim else 1.0


def hf_yarn(params: dict[str, Any], raw: dict[str, Any] | None, config: ModelConfig) -> Yarn:
    """YaRN from config.json's rope parameters (``raw``: the config, whose own original length a family
    reads where the parameters have none)."""
    key = "original_max_position_embeddings"
    original = int(params.get(key) or (raw or {}).get(key) or config.max_position_embeddings)
    factor = params.get("factor")
    attention_factor = params.get("attention_factor")
    return Yarn(
        factor=float(factor) if factor is not None else config.max_position_embeddings / original,
        original_max_positions=original,
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        mscale=float(params.get("mscale") or 0),
        mscale_all_dim=float(params.get("mscale_all_dim") or 0),
        attention_factor=None if attention_factor is None else float(attention_factor),
        truncate=bool(params.get("truncate", True)),
    )
