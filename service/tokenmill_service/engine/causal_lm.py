"""What the engine needs of a model: the interface it is written against (no model module imported).

``models/llama.py``'s ``LlamaForCausalLM`` is one; a test can hand the engine anything that fits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from tokenmill_service.ops.attention_metadata import AttentionMetadata


class CausalLM(Protocol):
    act_dtype: torch.dtype
    kv_dtype: torch.dtype  # what the KV cache stores
    quantization: str

    @property
    def device(self) -> torch.device: ...

    @property
    def max_positions(self) -> int: ...

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """[layers, blocks, block_size, this rank's kv heads, head_dim]."""
        ...

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [T, hidden] of a flat batch of T new tokens."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [N, vocab] for the given hidden rows."""
        ...

    def weight_bytes(self) -> int: ...

    def compile_regions(self, compile: Callable[[Callable[..., Any]], Callable[..., Any]] | None) -> None:
        """Run the model's compilable regions through ``compile`` (None: eager); see engine/compile.py."""
        ...
