"""Loading a decoder's weights: each checkpoint tensor (Hugging Face names) routed into its layer's
loader, q/k/v and gate/up packed as they arrive; then every layer checked complete and converted to its
kernel's layout. The same for every family: a module says which checkpoint projections it packs."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol, runtime_checkable

from torch import nn

from tokenmill_service.worker.layers.embedding import VocabParallelEmbedding
from tokenmill_service.worker.layers.linear import LinearBase, MergedColumnParallelLinear, QKVParallelLinear
from tokenmill_service.worker.layers.norm import RMSNorm
from tokenmill_service.worker.layers.quant.gguf_blocks import CheckpointTensor

# Checkpoint projections a Llama-shaped layer holds packed: name -> (layer, shard id).
PACKED_QKV_GATE_UP: Mapping[str, tuple[str, str | int]] = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}

# A piece of a layer's checkpoint tensors: ("weight" or "bias", its shard id).
_Piece = tuple[str, str | int | None]


@runtime_checkable
class LoadsWeight(Protocol):
    """A module that takes its weight from a checkpoint tensor (linear layers, norms, embeddings, sinks)."""

    def load_weight(self, tensor: CheckpointTensor, shard_id: Any = None) -> None: ...


def load_weights(
    model: nn.Module,
    tensors: Iterable[tuple[str, CheckpointTensor]],
    packed: Mapping[str, tuple[str, str | int]],
    tied: bool,
) -> None:
    """Route every tensor into ``model``'s layers (``tied``: the embedding is the head's weight too), check
    that every layer got all of its pieces, and convert them to the kernels' layouts (ValueError: a misfit)."""
    loaded: dict[str, set[_Piece]] = {}
    for name, tensor in tensors:
        targets = [name, "lm_head.weight"] if tied and name == "model.embed_tokens.weight" else [name]
        for target in targets:
            path, _, kind = target.rpartition(".")
            parent, _, leaf = path.rpartition(".")
            shard: str | int | None = None
            if leaf in packed:
                leaf, shard = packed[leaf]
                path = f"{parent}.{leaf}"
            try:
                module = model.get_submodule(path)
            except AttributeError:
                raise ValueError(f"checkpoint tensor {name!r} has no counterpart in the model") from None
            if kind == "bias" and isinstance(module, LinearBase):
                module.load_bias(tensor, shard)  # type: ignore[arg-type]
            elif kind == "weight" and isinstance(module, LoadsWeight):
                module.load_weight(tensor, shard)
            else:
                raise ValueError(f"checkpoint tensor {name!r} has no counterpart in the model")
            loaded.setdefault(path, set()).add((kind, shard))
    _check_complete(model, loaded)
    for module in model.modules():
        if isinstance(module, LinearBase):
            module.finalize()


def _check_complete(model: nn.Module, loaded: dict[str, set[_Piece]]) -> None:
    missing = []
    for path, module in model.named_modules():
        if isinstance(module, LinearBase):
            want: set[_Piece] = {("weight", s) for s in _shard_ids(module)}
            if module.bias is not None:
                want |= {("bias", s) for s in _shard_ids(module)}
        elif isinstance(module, (RMSNorm, VocabParallelEmbedding)):
            want = {("weight", None)}
        else:
            continue
        for kind, shard in sorted(want - loaded.get(path, set()), key=str):
            missing.append(f"{path}.{kind}" + ("" if shard is None else f" ({shard})"))
    if missing:
        raise ValueError(f"the checkpoint lacks {len(missing)} tensor(s): {', '.join(missing[:8])}")


def weight_bytes(model: nn.Module) -> int:
    """Bytes of weights one forward pass reads (linear layers as stored, embedding rows aside)."""
    total = sum(m.quant.weight_bytes(m) for m in model.modules() if isinstance(m, LinearBase))
    norms = sum(m.weight.numel() * 4 for m in model.modules() if isinstance(m, RMSNorm))
    return total + norms


def _shard_ids(module: LinearBase) -> list[str | int | None]:
    if isinstance(module, QKVParallelLinear):
        return ["q", "k", "v"]
    if isinstance(module, MergedColumnParallelLinear):
        return list(range(len(module.local_sizes)))
    return [None]
