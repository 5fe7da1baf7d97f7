"""The architecture hyper-parameters of a Llama-family decoder, whatever file they came from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import SupportsInt

from tokenmill_service.worker.layers.rotary import RopeScaling


@dataclass(slots=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    max_position_embeddings: int
    head_dim: int = 0  # 0: hidden_size // num_heads
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has biases on q/k/v
    architecture: str = "llama"
    name: str = "model"
    extra: dict[str, object] = field(default_factory=dict)

    def extra_int(self, key: str) -> int:
        """``extra[key]``, one of the family's counts, as an int (0 where the family has none)."""
        value = self.extra.get(key, 0)
        if not isinstance(value, SupportsInt):
            raise TypeError(f"the model config's {key} is {value!r}, not a number")
        return int(value)

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            self.head_dim = self.hidden_size // self.num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")


SLIDING, FULL = "sliding_attention", "full_attention"


def layer_window(config: ModelConfig, layer_idx: int) -> int | None:
    """The sliding window of layer ``layer_idx``, in tokens (a query at position p sees p - window + 1 .. p,
    as transformers' sliding-window mask), or None: it attends to the whole context.

    ``extra["sliding_window"]`` is the window (absent or None: no layer has one); ``extra["layer_types"]``
    says which layers have it (``SLIDING`` / ``FULL`` per layer; absent: every layer, as Mistral and Phi-3).
    A window as long as the context is none."""
    window = config.extra.get("sliding_window")
    if not isinstance(window, int) or window >= config.max_position_embeddings:
        return None
    layer_types = config.extra.get("layer_types")
    if isinstance(layer_types, list) and layer_types[layer_idx] != SLIDING:
        return None
    return window


def has_windows(config: ModelConfig) -> bool:
    """Whether any layer attends within a sliding window."""
    return any(layer_window(config, i) is not None for i in range(config.num_layers))


__all__ = ["FULL", "SLIDING", "ModelConfig", "RopeScaling", "has_windows", "layer_window"]
