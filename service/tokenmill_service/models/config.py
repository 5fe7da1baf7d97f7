"""The architecture hyper-parameters of a Llama-family decoder, whatever file they came from."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill_service.layers.rotary import RopeScaling


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

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            self.head_dim = self.hidden_size // self.num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")


__all__ = ["ModelConfig", "RopeScaling"]
