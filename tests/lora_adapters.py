"""Tiny random Llama checkpoints and PEFT LoRA adapters for them, made in the test (never downloaded)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

TINY_LLAMA = dict(  # noqa: C408 - keyword names as in the transformers config
    vocab_size=96,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,  # head_dim 64: a head the native attention kernel takes
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def tiny_llama(directory: Path, seed: int = 0, **overrides: Any) -> Any:
    """A random transformers Llama saved (safetensors) in ``directory``; returns the module."""
    import transformers

    from tests.engine.test_gguf_loader import _randomize

    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**TINY_LLAMA, **overrides}))
    _randomize(model, seed=seed + 1)
    model.eval().save_pretrained(directory, safe_serialization=True)
    return model


def make_adapter(
    base: Any, directory: Path, rank: int, seed: int, targets: list[str] | None = None, rslora: bool = False
) -> Path:
    """A PEFT LoRA adapter of ``base`` with random A and B (both nonzero), saved with ``save_pretrained``."""
    import copy

    import peft

    config = peft.LoraConfig(
        r=rank, lora_alpha=2 * rank if not rslora else 16, target_modules=targets or ALL_TARGETS, use_rslora=rslora
    )
    model = peft.get_peft_model(copy.deepcopy(base), config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    model.save_pretrained(directory)
    return directory


def peft_model(base: Any, adapter: Path) -> Any:
    import copy

    import peft

    return peft.PeftModel.from_pretrained(copy.deepcopy(base), str(adapter)).eval()
