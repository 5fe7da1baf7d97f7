"""The sizes that decide how a model splits over ranks, read from a checkpoint without torch.

The server process checks ``--tensor-parallel`` against them before any worker starts (it never
imports torch); the loader checks the same sizes again from the full ``ModelConfig``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True, slots=True)
class ModelDims:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    # The checkpoint's largest quantization block in weights (1: none) and its format: a rank's slice
    # of a row-parallel layer's inputs holds whole blocks.
    block: int = 1
    block_format: str = ""
    # A mixture of experts: how many experts its layers hold and each one's width (0: a dense model).
    num_experts: int = 0
    expert_width: int = 0


def is_gguf(path: Path) -> bool:
    if not path.is_file():
        return False
    with path.open("rb") as f:
        return f.read(4) == GGUF_MAGIC


def read_dims(path: Path) -> ModelDims:
    """The sizes of a GGUF file or a Hugging Face directory (config.json); ValueError if unreadable."""
    if is_gguf(path):
        return _gguf_dims(path)
    config = path / "config.json"
    if not config.is_file():
        raise ValueError(f"{path}: neither a GGUF file nor a directory with config.json")
    raw: dict[str, Any] = json.loads(config.read_text())
    heads = int(raw["num_attention_heads"])
    experts = int(raw.get("num_local_experts") or raw.get("num_experts") or 0)
    first_dense = raw.get("first_k_dense_replace")  # DeepSeek-V3: experts from that layer on, if any
    if raw.get("n_routed_experts") and first_dense is not None and int(first_dense) < int(raw["num_hidden_layers"]):
        experts = int(raw["n_routed_experts"])
    return ModelDims(
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or int(raw["hidden_size"]) // heads),
        intermediate_size=int(raw["intermediate_size"]),
        vocab_size=int(raw["vocab_size"]),
        num_experts=experts,
        expert_width=int(raw.get("moe_intermediate_size") or raw["intermediate_size"]) if experts else 0,
    )


def largest_block(types: Iterable[int]) -> tuple[int, str]:
    """The most weights per block among ggml tensor types ``types`` and that format's name; (1, "")
    when none is block-quantized (float types hold one weight a "block")."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, name = 1, ""
    for qtype in sorted(map(GGMLQuantizationType, set(types))):
        weights = GGML_QUANT_SIZES[qtype][0]
        if weights > block:
            block, name = weights, qtype.name
    return block, name


def _gguf_dims(path: Path) -> ModelDims:
    from tokenmill_service.contract.gguf_reader import open_gguf

    reader = open_gguf(path)

    def field(key: str) -> Any:
        f = reader.get_field(key)
        return None if f is None else f.contents()

    arch = field("general.architecture")
    heads = int(field(f"{arch}.attention.head_count"))
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    key_length = field(f"{arch}.attention.key_length")
    block, block_format = largest_block(int(t.tensor_type) for t in reader.tensors)
    experts = int(field(f"{arch}.expert_count") or 0)
    width = field(f"{arch}.expert_feed_forward_length") or field(f"{arch}.feed_forward_length")
    return ModelDims(
        num_heads=heads,
        num_kv_heads=int(field(f"{arch}.attention.head_count_kv") or heads),
        head_dim=int(key_length) if key_length is not None else int(field(f"{arch}.embedding_length")) // heads,
        intermediate_size=int(field(f"{arch}.feed_forward_length")),
        vocab_size=int(embd.shape[1]),  # GGUF lists dims innermost first: [hidden, vocab]
        block=block,
        block_format=block_format,
        num_experts=experts,
        expert_width=int(width) if experts else 0,
    )
