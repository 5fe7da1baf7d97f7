"""What the engine needs of a model: the interface it is written against (no model module imported).

``worker/models/decoder.py``'s ``DecoderForCausalLM`` (every family's module) is one; a test can hand the engine anything that fits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch
from torch import nn

from tokenmill_service.worker.kernels.attention_metadata import AttentionMetadata

if TYPE_CHECKING:
    from tokenmill_service.contract.plan.plan import LoadPlan
    from tokenmill_service.worker.layers.lora.adapter import BaseDims


class CausalLM(Protocol):
    act_dtype: torch.dtype
    kv_dtype: torch.dtype  # what the KV cache stores
    quantization: str
    plan: LoadPlan | None  # the load plan it was built from (None: built by hand, runs eager)
    # The functions a forward pass runs between attention calls (an executor may compile them).
    regions_type: ClassVar[type[Any]]
    # Its multi-token-prediction layers, the draft model of ``--speculative-method mtp`` (empty: none).
    mtp: nn.ModuleList

    @property
    def config(self) -> BaseDims:
        """Its dimensions (a ModelConfig): what a LoRA adapter is checked against."""
        ...

    @property
    def device(self) -> torch.device: ...

    @property
    def max_positions(self) -> int: ...

    def attention_windows(self) -> list[int | None]:
        """Each layer's sliding window in tokens (None: it attends to the whole context): the windowed
        layers' block tables free a sequence's blocks behind the widest (worker/engine/kv_cache_groups.py)."""
        ...

    def kv_cache_shapes(self, num_blocks: int, block_size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The (key, value) cache shapes, [layers, blocks, ...] each, in its ops backend's layout."""
        ...

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, *run: Any
    ) -> torch.Tensor:
        """Hidden states [T, hidden] of a flat batch of T new tokens (``run``: its regions, if not as they are)."""
        ...

    def compute_logits(self, hidden: torch.Tensor, *run: Any) -> torch.Tensor:
        """Float32 logits [N, vocab] for the given hidden rows."""
        ...

    def weight_bytes(self) -> int: ...
