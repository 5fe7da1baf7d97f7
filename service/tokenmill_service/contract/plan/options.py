"""What the user asked for a model, as one frozen value: made from ``Settings`` in the server and
passed whole through the router's worker spec to the loader, which turns it into a ``LoadPlan``.

Torch-free (the server process builds and ships it). Every field is the flag's text, unresolved:
``auto`` stays ``auto`` here; ``resolve_plan`` decides what it means on the worker's device.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenmill_service.contract.plan.cpu_isa import ENV as CPU_ISA_ENV

if TYPE_CHECKING:
    from tokenmill_service.contract.config import Settings


@dataclass(frozen=True, slots=True)
class LoadOptions:
    # A GGUF file or a Hugging Face directory; empty: the embedded default model.
    model: str = ""
    device: str = "cpu"
    # Activations: auto, float32 or bfloat16.
    dtype: str = "auto"
    # The linear layers' method: auto, or a registered name (gguf-vnni, gguf, none, int8, int4, ...).
    quantization: str = "auto"
    # The ops family asked for: torch (the best ops torch runs here: native CPU kernels where they
    # serve, else the reference), or a registered backend by name (triton, native, ...).
    backend: str = "torch"
    # What the KV cache stores: auto (the activations' dtype), float32 or float16.
    kv_cache_dtype: str = "auto"
    # What the native integer-product kernels round the activations to: auto (16-bit fixed point) or int8.
    activations: str = "auto"
    # The instruction set of the native CPU kernels: auto, scalar, avx2, avx2vnni, avx512 or neon (the same bits each).
    # Unless given, --cpu-isa's environment form (TOKENMILL_CPU_ISA), as the server's flag reads it: loading
    # makes the choice the process's (cpu_isa.use), which must not undo what the environment asked.
    cpu_isa: str = field(default_factory=lambda: os.environ.get(CPU_ISA_ENV) or "auto")
    # torch.compile the forward pass where it can (auto) or not (off).
    compile: str = "off"
    # Ranks one replica spans.
    tensor_parallel: int = 1
    # Mixture-of-experts layers: each rank holds whole experts (experts / ranks) instead of a slice of each.
    expert_parallel: bool = False
    # LoRA adapter slots resident at once (0: adapters off) and the largest rank they take.
    max_loras: int = 0
    max_lora_rank: int = 16
    # Where speculation's drafts come from: "ngram" (the sequence's own history) or "mtp" (the
    # checkpoint's multi-token-prediction layers, which the model then loads).
    speculative_method: str = "ngram"
    # The context served (--max-model-len; 0: the model's own): a family whose rotary scaling depends on
    # the context length (LongRoPE) chooses its factors by it, once, for every position.
    max_model_len: int = 0

    @classmethod
    def from_settings(cls, settings: Settings) -> LoadOptions:
        """Every field from the flag of its name."""
        return settings.subset(cls)
