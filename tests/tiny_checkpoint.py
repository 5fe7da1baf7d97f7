"""A tiny random Llama checkpoint (Hugging Face layout) written into a directory, for service tests
that need a real model but not a good one: two layers, head_dim 32, two query heads per KV head, a
byte-level tokenizer of 256 bytes + EOS; the byte-level tokenizer and the weight sharpening every
served-family test's checkpoint uses."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_byte_level_tokenizer(directory: Path, *more_special: str) -> None:
    """tokenizer.json and tokenizer_config.json: byte-level BPE over the 256 bytes (no merges), EOS as id 256,
    then ``more_special``."""
    import tokenizers

    alphabet = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.add_special_tokens(["<|eos|>", *more_special])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eos|>"}))


def sharpen(model: Any, norm_center: float = 1.0) -> Any:
    """Weights sharper than transformers' initialisation (so greedy choices are no near-ties) and norms
    away from ``norm_center`` (1; Gemma's 0, as it multiplies by 1 + w), drawn from torch's global
    generator (seed it first); ``model`` in eval mode."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(torch.randn_like(param) * (0.1 if "norm" in name else 0.2) + ("norm" in name) * norm_center)
    return model.eval()


def write_tiny_llama(directory: Path) -> Path:
    import torch
    import transformers

    write_byte_level_tokenizer(directory)
    config = transformers.LlamaConfig(
        vocab_size=257,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = sharpen(transformers.LlamaForCausalLM(config))
    model.save_pretrained(directory, safe_serialization=True)
    return directory
