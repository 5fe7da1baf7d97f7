"""A LoRA adapter in PEFT's format: ``adapter_config.json`` + ``adapter_model.safetensors``.

Each targeted projection ``W`` [out, in] of the base gets ``y += scale * (x @ A.T) @ B.T`` with
``A`` [r, in] and ``B`` [out, r]; ``scale`` is ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with
rsLoRA. ``read_adapter`` reads the config and checks every tensor against the base's shapes
without loading them (``AdapterError`` names the mismatch); ``tensors`` loads them when a slot
takes the adapter. An adapter of a checkpoint with fused projections (Phi-3's ``qkv_proj`` and
``gate_up_proj``) shares one A among the parts, B's rows part after part: each part gets the A and its
rows of B, which the packed layer takes as it takes an adapter of the separate projections.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
# The projections an adapter may target, by the name PEFT gives them (Hugging Face's).
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Fused projections of checkpoints that hold them whole (Phi-3's qkv_proj and gate_up_proj): one A for
# the parts and B's rows part after part, so each part is (A, its slice of B).
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_KEY = re.compile(
    r"^(?:base_model\.model\.)?(model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+))\.lora_([AB])(?:\.\w+)?\.weight$"
)


class BaseDims(Protocol):
    """What an adapter is checked against: the base model's dimensions (its ModelConfig)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int


class AdapterError(ValueError):
    """An adapter that cannot be served on this base; the message names what does not fit."""


@dataclass(frozen=True, slots=True)
class LoRAAdapter:
    name: str
    path: str
    rank: int
    alpha: float
    rslora: bool
    # The projections it changes, by checkpoint name ("model.layers.0.self_attn.q_proj").
    modules: tuple[str, ...] = field(default_factory=tuple)
    # A GGUF LoRA file (llama.cpp's): the q/k heads whose B rows are put back in Hugging Face's order
    # (None: a PEFT directory, or nothing to put back).
    gguf_heads: tuple[int, int] | None = None
    gguf: bool = False
    # The rows of each part of a fused projection the adapter targets (FUSED), as (part, rows).
    part_rows: tuple[tuple[str, int], ...] = ()

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

    @property
    def targets(self) -> list[str]:
        return sorted({m.rpartition(".")[2] for m in self.modules})

    def tensors(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Each module's (A [r, in], B [out, r]) as float32."""
        if self.gguf:
            from tokenmill_service.worker.layers.lora.gguf import read_gguf, unpermute

            _, found = read_gguf(self.path)
            if self.gguf_heads is not None:
                for name, (a, b) in found.items():
                    if name.endswith(("q_proj", "k_proj")):
                        heads = self.gguf_heads[0 if name.endswith("q_proj") else 1]
                        found[name] = (a, unpermute(b, heads))
            return found
        from safetensors.torch import load_file

        pairs: dict[str, dict[str, torch.Tensor]] = {}
        for key, tensor in load_file(str(Path(self.path) / WEIGHTS_FILE)).items():
            m = _KEY.match(key)
            if m:
                pairs.setdefault(m.group(1), {})[m.group(4)] = tensor.float()
        out = {}
        for name, ab in pairs.items():
            parent, _, leaf = name.rpartition(".")
            if leaf not in FUSED:
                out[name] = (ab["A"], ab["B"])
                continue
            start = 0
            for part in FUSED[leaf]:
                rows = dict(self.part_rows)[part]
                out[f"{parent}.{part}"] = (ab["A"], ab["B"][start : start + rows])
                start += rows
        return out


def expected_shape(config: BaseDims, leaf: str) -> tuple[int, int]:
    """The (out, in) of a base projection, whole (before any tensor-parallel split)."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    h, i = config.hidden_size, config.intermediate_size
    return {
        "q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
        "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i),
        "qkv_proj": (q + 2 * kv, h), "gate_up_proj": (2 * i, h),
    }[leaf]  # fmt: skip


def read_adapter(name: str, path: str | Path, config: BaseDims, max_rank: int) -> LoRAAdapter:
    """The adapter at ``path``, checked against the base ``config`` and the served ``max_rank``."""
    from tokenmill_service.worker.layers.lora.gguf import is_gguf

    if is_gguf(path):
        return _read_gguf_adapter(name, Path(path), config, max_rank)
    directory = Path(path)
    if not (directory / CONFIG_FILE).is_file() or not (directory / WEIGHTS_FILE).is_file():
        raise AdapterError(
            f"{path} is not a LoRA adapter: a PEFT directory needs {CONFIG_FILE} and {WEIGHTS_FILE}, "
            "or give a GGUF LoRA file"
        )
    try:
        raw = json.loads((directory / CONFIG_FILE).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise AdapterError(f"{directory / CONFIG_FILE} cannot be read: {e}") from None
    if str(raw.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterError(f"adapter {name!r} is a {raw.get('peft_type')} adapter; only LoRA is served")
    for key, what in (
        ("use_dora", "DoRA"),
        ("rank_pattern", "per-module ranks"),
        ("alpha_pattern", "per-module alphas"),
    ):
        if raw.get(key):
            raise AdapterError(f"adapter {name!r} uses {what} ({key}), which is not served")
    if raw.get("bias", "none") != "none":
        raise AdapterError(f"adapter {name!r} trains biases (bias={raw['bias']!r}); only bias='none' is served")
    if raw.get("modules_to_save"):
        raise AdapterError(
            f"adapter {name!r} saves whole modules ({raw['modules_to_save']}); only LoRA pairs are served"
        )
    rank, alpha = int(raw.get("r", 8)), float(raw.get("lora_alpha", 8))
    if rank > max_rank:
        raise AdapterError(f"adapter {name!r} has rank {rank}, above the served --max-lora-rank {max_rank}")
    if rank < 1:
        raise AdapterError(f"adapter {name!r} has rank {rank}")
    from safetensors import safe_open

    shapes: dict[str, dict[str, tuple[int, ...]]] = {}
    with safe_open(str(directory / WEIGHTS_FILE), framework="pt") as f:
        for key in f.keys():  # noqa: SIM118 - safe_open has keys(), not iteration
            m = _KEY.match(key)
            if m is None:
                raise AdapterError(f"adapter {name!r} has a tensor {key!r} that targets no servable projection")
            module, leaf, which = m.group(1), m.group(3), m.group(4)
            if leaf not in TARGETS and leaf not in FUSED:
                raise AdapterError(
                    f"adapter {name!r} targets {leaf}, which is not one of {', '.join((*TARGETS, *FUSED))}"
                )
            shapes.setdefault(module, {})[which] = tuple(f.get_slice(key).get_shape())
    _check_shapes(name, shapes, config, rank)
    fused = {m.rpartition(".")[2] for m in shapes} & set(FUSED)
    parts = tuple((part, expected_shape(config, part)[0]) for leaf in sorted(fused) for part in FUSED[leaf])
    return LoRAAdapter(
        name, str(directory), rank, alpha, bool(raw.get("use_rslora", False)), tuple(sorted(shapes)), part_rows=parts
    )


def _check_shapes(name: str, shapes: dict[str, dict[str, tuple[int, ...]]], config: BaseDims, rank: int) -> None:
    if not shapes:
        raise AdapterError(f"adapter {name!r} holds no LoRA tensors")
    for module, ab in sorted(shapes.items()):
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"adapter {name!r} has lora_A without lora_B (or the reverse) for {module}")
        layer = int(module.split(".")[2])
        if layer >= config.num_layers:
            raise AdapterError(f"adapter {name!r} targets layer {layer}; the base has {config.num_layers} layers")
        out, inp = expected_shape(config, module.rpartition(".")[2])
        if ab["A"] != (rank, inp) or ab["B"] != (out, rank):
            raise AdapterError(
                f"adapter {name!r} does not fit the base at {module}: lora_A is {list(ab['A'])} and lora_B "
                f"{list(ab['B'])}; rank {rank} on this base needs [{rank}, {inp}] and [{out}, {rank}]"
            )


def _read_gguf_adapter(name: str, path: Path, config: BaseDims, max_rank: int) -> LoRAAdapter:
    """A llama.cpp GGUF LoRA file (worker/layers/lora/gguf.py), checked as a PEFT adapter is."""
    from tokenmill_service.worker.layers.lora.gguf import PERMUTED, read_gguf

    try:
        meta, pairs = read_gguf(path)
    except (ValueError, KeyError) as e:
        raise AdapterError(f"adapter {name!r} ({path}): {e}") from None
    if meta["type"] != "adapter" or meta["adapter_type"] != "lora":
        raise AdapterError(
            f"{path} is a GGUF file but not a LoRA adapter (general.type {meta['type']!r}, "
            f"adapter.type {meta['adapter_type']!r})"
        )
    ranks = {a.shape[0] for a, _ in pairs.values()}
    if len(ranks) > 1:
        raise AdapterError(f"adapter {name!r} has several ranks ({sorted(ranks)}), which is not served")
    rank = ranks.pop() if ranks else 0
    if rank > max_rank:
        raise AdapterError(f"adapter {name!r} has rank {rank}, above the served --max-lora-rank {max_rank}")
    shapes = {m: {"A": tuple(a.shape), "B": tuple(b.shape)} for m, (a, b) in pairs.items()}
    _check_shapes(name, shapes, config, rank)
    # llama.cpp: scale alpha / r, and 1 when the file has no alpha.
    alpha = float(meta["alpha"]) if meta["alpha"] else float(rank)
    heads = (config.num_heads, config.num_kv_heads) if meta["architecture"] in PERMUTED else None
    return LoRAAdapter(name, str(path), rank, alpha, False, tuple(sorted(shapes)), heads, gguf=True)
