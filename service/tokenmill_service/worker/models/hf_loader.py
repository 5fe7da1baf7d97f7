"""Read a Hugging Face checkpoint directory (``config.json`` + safetensors) into a config and state dict.

Only safetensors are read: they hold raw tensors, so loading never runs code from the file
(``pytorch_model.bin`` is a pickle and is refused).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from tokenmill_service.worker.layers.quant.fp8_tensor import Fp8Blocks
from tokenmill_service.worker.layers.quant.gguf_blocks import CheckpointTensor, dense
from tokenmill_service.worker.layers.quant.mxfp4 import from_openai
from tokenmill_service.worker.models.config import ModelConfig, RopeScaling
from tokenmill_service.worker.models.registry import family, hf_architectures, unfused

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"

# Buffers some older checkpoints saved; the decoder recomputes them.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# A base model's tensors (transformers' Qwen3Model, as sentence-transformers saves an embedding model) are
# named without the "model." of the causal LM's.
_BASE_MODEL_PREFIXES = ("embed_tokens.", "layers.", "norm.")
# FP8 block-scaled weights: the scales of ``<name>.weight`` are ``<name>.weight_scale_inv`` (read with it).
FP8_SCALE_SUFFIX = ".weight_scale_inv"
# MXFP4 (quant_method mxfp4): ``<name>_blocks`` and its ``<name>_scales`` (read together, in one file).
MXFP4_BLOCKS, MXFP4_SCALES = "_blocks", "_scales"


class HFCheckpointError(ValueError):
    """The directory is not a Hugging Face checkpoint this service can run."""


def is_hf_checkpoint(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def rope_params(raw: dict[str, Any]) -> dict[str, Any]:
    """The RoPE parameters of a config.json: transformers 5 writes "rope_parameters" (with rope_theta
    inside); older versions "rope_scaling". Empty where there are none."""
    params: dict[str, Any] = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    return params


def rope_type(params: dict[str, Any]) -> str:
    return str(params.get("rope_type", params.get("type", "default")))


def _rope_scaling(raw: dict[str, Any], family_types: frozenset[str] = frozenset()) -> RopeScaling | None:
    params = rope_params(raw)
    kind = rope_type(params)
    if kind == "default" or kind in family_types:
        return None  # a family's own type: its spec's config reader reads it
    if kind != "llama3":
        raise HFCheckpointError(f"RoPE scaling type {kind!r} is not supported (supported: llama3)")
    defaults = RopeScaling()
    return RopeScaling(
        factor=float(params.get("factor", defaults.factor)),
        low_freq_factor=float(params.get("low_freq_factor", defaults.low_freq_factor)),
        high_freq_factor=float(params.get("high_freq_factor", defaults.high_freq_factor)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", defaults.original_max_position_embeddings)
        ),
    )


def _rope_theta(raw: dict[str, Any]) -> float:
    if "rope_theta" in raw:
        return float(raw["rope_theta"])
    params = raw.get("rope_parameters") or {}
    return float(params.get("rope_theta", 10000.0))


def read_hf_config(directory: Path) -> ModelConfig:
    raw: dict[str, Any] = json.loads((directory / "config.json").read_text())
    archs = raw.get("architectures") or []
    supported = hf_architectures()
    arch = next((a for a in archs if a in supported), None)
    if arch is None:
        raise HFCheckpointError(
            f"{directory / 'config.json'}: architectures {archs} not supported (supported: {', '.join(sorted(supported))})"
        )
    spec = family(supported[arch])
    act_key, activation = spec.config.hf_activation
    if raw.get(act_key, activation) != activation:
        raise HFCheckpointError(f"{act_key} {raw[act_key]!r} is not supported (only {activation})")
    if raw.get("mlp_bias", False):
        raise HFCheckpointError("mlp_bias is not supported")
    num_heads = int(raw["num_attention_heads"])
    config = ModelConfig(
        vocab_size=int(raw["vocab_size"]),
        hidden_size=int(raw["hidden_size"]),
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        head_dim=int(raw.get("head_dim") or 0),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(raw),
        rope_scaling=_rope_scaling(raw, spec.config.hf_rope_types),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=bool(raw.get("attention_bias", False)),
        architecture=supported[arch],
        name=directory.name,
        extra={"format": "safetensors", "hf_architecture": arch, "model_type": raw.get("model_type")},
    )
    _read_quantization(raw, config)
    try:  # what only this family reads (Qwen2's biases, Mistral's window, ...)
        spec.config.read_hf(raw, arch, config)
    except ValueError as e:
        raise HFCheckpointError(f"{directory / 'config.json'}: {e}") from None
    return config


def _read_quantization(raw: dict[str, Any], config: ModelConfig) -> None:
    """The checkpoint's own quantization: FP8 block-scaled weights (``config.extra["fp8_block"]``, the
    block's rows and columns), or none; any other ``quantization_config`` is refused."""
    qc = raw.get("quantization_config")
    if not qc:
        return
    method = qc.get("quant_method")
    if method == "mxfp4":  # openai's: <name>_blocks / <name>_scales (worker/layers/quant/mxfp4.py)
        config.extra["mxfp4"] = True
        return
    if method != "fp8":
        raise HFCheckpointError(
            f"quantization_config quant_method {method!r} is not supported (supported: fp8 with "
            "weight_block_size, mxfp4)"
        )
    block = qc.get("weight_block_size")
    if not block or len(block) != 2:
        raise HFCheckpointError("FP8 checkpoints without weight_block_size (per-tensor scales) are not supported")
    if qc.get("fmt", "e4m3") != "e4m3":
        raise HFCheckpointError(f"FP8 format {qc['fmt']!r} is not supported (supported: e4m3)")
    config.extra["fp8_block"] = (int(block[0]), int(block[1]))


def _weight_files(directory: Path) -> list[Path]:
    index = directory / SAFETENSORS_INDEX
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return [directory / name for name in sorted(set(weight_map.values()))]
    single = directory / SAFETENSORS_FILE
    if single.is_file():
        return [single]
    raise HFCheckpointError(
        f"{directory}: no {SAFETENSORS_FILE} or {SAFETENSORS_INDEX} (only safetensors weights are loaded, never pickles)"
    )


def iter_hf(directory: Path) -> tuple[ModelConfig, Iterator[tuple[str, CheckpointTensor]]]:
    """Config and the checkpoint's tensors (as stored; a fused one as the layers it packs), read one at
    a time. A tied checkpoint's ``lm_head.weight`` copy is skipped: the head is loaded from the embedding."""
    config = read_hf_config(directory)
    files = _weight_files(directory)
    spec = family(config.architecture)
    scales: dict[str, Path] = {}  # FP8 weight name -> the file holding its weight_scale_inv
    if "fp8_block" in config.extra:
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118
                    if name.endswith(FP8_SCALE_SUFFIX):
                        scales[name.removesuffix("_scale_inv")] = file
        config.extra["fp8_weights"] = frozenset(scales)

    mxfp4 = bool(config.extra.get("mxfp4"))

    def items() -> Iterator[tuple[str, CheckpointTensor]]:
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open has keys() but is not iterable
                    if name.endswith(_IGNORED_SUFFIXES) or name.endswith(FP8_SCALE_SUFFIX):
                        continue
                    if mxfp4 and name.endswith(MXFP4_SCALES):
                        continue  # read with its blocks
                    if mxfp4 and name.endswith(MXFP4_BLOCKS):
                        e8m0 = f.get_tensor(name.removesuffix(MXFP4_BLOCKS) + MXFP4_SCALES)
                        yield name.removesuffix(MXFP4_BLOCKS), from_openai(f.get_tensor(name), e8m0)
                        continue
                    if config.tie_word_embeddings and name == "lm_head.weight":
                        continue
                    tensor: CheckpointTensor = f.get_tensor(name)
                    if name in scales:
                        tensor = _fp8_blocks(tensor, scales[name], name, config)
                    if name.startswith(_BASE_MODEL_PREFIXES):  # a base model's (Qwen3-Embedding's): no "model."
                        name = f"model.{name}"
                    pieces = unfused(spec, name, config)
                    for piece, start, rows in pieces:
                        yield piece, tensor if rows < 0 else tensor.narrow(0, start, rows)

    return config, items()


def _fp8_blocks(values: CheckpointTensor, file: Path, name: str, config: ModelConfig) -> Fp8Blocks:
    with safe_open(str(file), framework="pt") as f:
        scale_inv = f.get_tensor(name + "_scale_inv")
    assert isinstance(values, torch.Tensor)
    block: tuple[int, int] = config.extra["fp8_block"]  # type: ignore[assignment]
    try:
        return Fp8Blocks(values, scale_inv.float(), block)
    except ValueError as e:
        raise HFCheckpointError(f"{name}: {e}") from None


def load_hf(directory: Path, dtype: torch.dtype = torch.float32) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Config and state dict (``dtype``, on CPU) of a Hugging Face checkpoint directory.

    Tied checkpoints get no ``lm_head.weight`` entry even where the file carries a copy.
    """
    config, items = iter_hf(directory)
    return config, {name: dense(t).to(dtype) for name, t in items}


__all__ = [
    "HFCheckpointError",
    "is_hf_checkpoint",
    "iter_hf",
    "load_hf",
    "read_hf_config",
]
