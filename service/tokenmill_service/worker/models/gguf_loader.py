"""Read a GGUF checkpoint (llama.cpp's format): a ``ModelConfig`` and its tensors under Hugging Face names.

The file is memory-mapped by ``gguf.GGUFReader``. Float tensors become float32 torch tensors;
block-quantized ones (every format of abi.py's table: Q4_0 .. Q8_0, the k-quants Q2_K .. Q6_K,
IQ4_NL/IQ4_XS) stay ``GGUFBlocks`` over the mapping, so that each layer takes its slice and its
quantization method decides (the native kernels serve Q4_0/Q4_1/Q8_0 as stored, int4 serves Q4_x
as it is, anything else is dequantized exactly). Llama-arch q/k rows are put back in Hugging Face
order (llama.cpp's converter permutes them for its RoPE).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import structlog
import torch
from gguf import GGMLQuantizationType as QType

from tokenmill_service.contract.gguf_reader import open_gguf
from tokenmill_service.worker.layers.quant.gguf_blocks import BLOCK_WEIGHTS, FLOAT_TYPES, GGUFBlocks
from tokenmill_service.worker.layers.rotary import rope_inv_freq
from tokenmill_service.worker.models.config import ModelConfig, RopeScaling
from tokenmill_service.worker.models.registry import family, gguf_architectures, unfused
from tokenmill_service.worker.models.spec import FamilySpec

log = structlog.get_logger(__name__)

SUPPORTED_TENSOR_TYPES = (*FLOAT_TYPES, *BLOCK_WEIGHTS)

_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_ROPE_FREQS = "rope_freqs.weight"

# What a GGUF file's tensor becomes: float weights dense, quantized ones as their blocks.
GGUFTensor = torch.Tensor | GGUFBlocks


class GGUFError(ValueError):
    """The GGUF file is not one this service can run (architecture, tensor type, metadata)."""


# --- metadata -----------------------------------------------------------------------------------


def _field(reader: gguf.GGUFReader, key: str) -> Any:
    field = reader.get_field(key)
    return None if field is None else field.contents()


def _required(reader: gguf.GGUFReader, key: str) -> Any:
    value = _field(reader, key)
    if value is None:
        raise GGUFError(f"GGUF metadata lacks {key!r}")
    return value


def read_config(reader: gguf.GGUFReader, path: Path) -> ModelConfig:
    """The model hyper-parameters from the GGUF metadata (and the tensor list, for ties and biases)."""
    arch = _required(reader, "general.architecture")
    supported = gguf_architectures()
    if arch not in supported:
        raise GGUFError(f"GGUF architecture {arch!r} is not supported (supported: {', '.join(sorted(supported))})")
    names = {t.name for t in reader.tensors}
    if "token_embd.weight" not in names:
        raise GGUFError("GGUF file has no token_embd.weight tensor")
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    # GGUF lists dims innermost first: token_embd is [hidden, vocab]. The tensor is the truth
    # the weights must fit; metadata vocab counts can disagree when the table is padded.
    vocab_size = int(embd.shape[1])
    meta_vocab = _field(reader, f"{arch}.vocab_size")
    if meta_vocab is None:
        tokens = reader.get_field("tokenizer.ggml.tokens")
        meta_vocab = None if tokens is None else len(tokens.data)
    if meta_vocab is not None and int(meta_vocab) != vocab_size:
        log.warning("gguf_vocab_mismatch", metadata_vocab=int(meta_vocab), embedding_rows=vocab_size)

    hidden = int(_required(reader, f"{arch}.embedding_length"))
    num_heads = int(_required(reader, f"{arch}.attention.head_count"))
    key_length = _field(reader, f"{arch}.attention.key_length")
    head_dim = int(key_length) if key_length is not None else hidden // num_heads
    spec = family(supported[arch])
    if not spec.config.gguf_reads_attention:  # else the family reads its own head sizes and RoPE scaling
        rope_dims = _field(reader, f"{arch}.rope.dimension_count")
        if rope_dims is not None and int(rope_dims) != head_dim:
            raise GGUFError(f"partial rotary embeddings (rope.dimension_count {rope_dims} != head_dim {head_dim})")
        scaling_type = _field(reader, f"{arch}.rope.scaling.type")
        if scaling_type not in (None, "none", *spec.config.gguf_rope_types):
            raise GGUFError(f"RoPE scaling type {scaling_type!r} is not supported")

    name = _field(reader, "general.name")
    config = ModelConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=int(_required(reader, f"{arch}.feed_forward_length")),
        num_layers=int(_required(reader, f"{arch}.block_count")),
        num_heads=num_heads,
        num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv") or num_heads),
        max_position_embeddings=int(_required(reader, f"{arch}.context_length")),
        head_dim=head_dim,
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon") or 1e-5),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base") or 10000.0),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        architecture=supported[arch],
        name=str(name) if name else path.stem,
        extra={"format": "gguf", "gguf_architecture": arch, "general.name": name},
    )
    if _ROPE_FREQS in names:
        factors = dequantize_tensor(next(t for t in reader.tensors if t.name == _ROPE_FREQS))
        config.rope_scaling = _llama3_scaling_from_factors(factors, config)
    for t in reader.tensors:  # tensors that are the family's settings, not weights (Phi-3's LongRoPE factors)
        if t.name in spec.config.gguf_config_tensors:
            config.extra[spec.config.gguf_config_tensors[t.name]] = dequantize_tensor(t).flatten().tolist()
    try:  # what only this family reads (Granite's multipliers, ...)
        spec.config.gguf(lambda key: _field(reader, key), arch, config)
    except ValueError as e:
        raise GGUFError(f"{path}: {e}") from None
    return config


def _llama3_scaling_from_factors(factors: torch.Tensor, config: ModelConfig) -> RopeScaling:
    """Llama 3.x GGUFs store per-frequency divisors (``rope_freqs``) instead of the scaling recipe.

    Recover the recipe by trying Llama 3's published parameters with the file's largest divisor
    as the factor, and insist it reproduces every divisor; anything else is refused, not guessed.
    """
    candidate = RopeScaling(factor=float(factors.max()))
    plain = rope_inv_freq(config.head_dim, config.rope_theta, None).double()
    scaled = rope_inv_freq(config.head_dim, config.rope_theta, candidate).double()
    if factors.numel() == plain.numel() and torch.allclose(plain / scaled, factors.double(), rtol=1e-3):
        return candidate
    raise GGUFError("rope_freqs tensor does not match Llama 3 RoPE scaling; this RoPE variant is not supported")


# --- tensors ------------------------------------------------------------------------------------


def _check_type(qtype: QType) -> None:
    if qtype not in SUPPORTED_TENSOR_TYPES:
        raise GGUFError(
            f"GGUF tensor type {qtype.name} is not supported "
            f"(supported: {', '.join(t.name for t in SUPPORTED_TENSOR_TYPES)}); re-quantize the model to one of those"
        )


def checkpoint_tensor(raw: np.ndarray, qtype: QType, shape: tuple[int, ...]) -> GGUFTensor:
    """A float tensor (F32/F16/BF16, converted to float32) or the still-quantized blocks (any block format)."""
    _check_type(qtype)
    if len(shape) == 3:  # a stack of matrices (a layer's experts): one matrix of all their rows
        shape = (shape[0] * shape[1], shape[2])
    if qtype not in FLOAT_TYPES:
        rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        blocks = GGUFBlocks.from_raw(raw, qtype, (rows, shape[-1]))
        # Matrices stay quantized for the layers; anything else is dequantized to its shape now.
        return blocks if len(shape) == 2 else blocks.dequantize().reshape(shape)
    data = torch.from_numpy(np.array(raw, copy=True))
    if qtype == QType.F32:
        out = data.view(torch.float32)
    elif qtype == QType.F16:
        out = data.view(torch.float16).float()
    else:
        out = data.view(torch.uint8).view(torch.bfloat16).float()
    return out.reshape(shape)


def dequantize(raw: np.ndarray, qtype: QType, shape: tuple[int, ...]) -> torch.Tensor:
    """Float32 weights from a GGUF tensor's raw data, in torch ``shape``; bit for bit what
    ``gguf.quants.dequantize`` gives."""
    t = checkpoint_tensor(raw, qtype, shape)
    return t.dequantize() if isinstance(t, GGUFBlocks) else t


def tensor_shape(tensor: Any) -> tuple[int, ...]:
    """Torch layout ([out, in]) of a GGUF tensor, whose shape GGUF lists innermost dimension first."""
    return tuple(int(n) for n in reversed(tensor.shape))


def dequantize_tensor(tensor: Any) -> torch.Tensor:
    return dequantize(tensor.data, QType(tensor.tensor_type), tensor_shape(tensor))


# --- q/k row order ------------------------------------------------------------------------------


def unpermute_index(rows: int, num_heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's q/k row permutation (``LlamaModel.permute`` in convert_hf_to_gguf.py).

    Per head, the converter interleaves the two rotary halves (rows 0, d/2, 1, d/2+1, ...) for
    ggml's pairwise RoPE; the decoder rotates halves, so rows go back as ``[first half, second half]``.
    """
    return torch.arange(rows).reshape(num_heads, rows // num_heads // 2, 2).transpose(1, 2).reshape(-1)


def unpermute_qk(weight: GGUFTensor, num_heads: int) -> GGUFTensor:
    """``weight`` (rows [, in]; dense, a bias, or quantized blocks) with its rows put back in Hugging Face order."""
    index = unpermute_index(weight.shape[0], num_heads)
    return weight.rows(index) if isinstance(weight, GGUFBlocks) else weight[index].contiguous()


# --- the whole checkpoint -----------------------------------------------------------------------


def hf_name(gguf_name: str, spec: FamilySpec) -> str:
    """The model's (Hugging Face) name of a GGUF tensor, by the family's map of llama.cpp's names;
    unknown tensors are an error, not skipped."""
    names = spec.tensors
    if gguf_name in names.gguf_global:
        return names.gguf_global[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match and match.group(2) in names.gguf_layer:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{names.gguf_layer[part]}.{kind}"
    raise GGUFError(f"GGUF tensor {gguf_name!r} has no counterpart in the {spec.module.__name__} model")


def iter_gguf(
    path: Path, reader: gguf.GGUFReader | None = None
) -> tuple[ModelConfig, dict[str, QType], Iterator[tuple[str, GGUFTensor]]]:
    """Config, each tensor's GGUF type (by the model's name; a fused tensor's type under each layer it
    packs), and the tensors themselves, lazily: block-quantized ones stay memory-mapped blocks until a
    layer takes its slice. ``reader``: the file already opened (``open_gguf``)."""
    reader = reader if reader is not None else open_gguf(path)
    config = read_config(reader, path)
    spec = family(config.architecture)
    permuted = config.extra["gguf_architecture"] in spec.names.gguf_permuted
    # rope_freqs and the family's settings tensors are folded into the config (read_config).
    tensors = [t for t in reader.tensors if t.name != _ROPE_FREQS and t.name not in spec.config.gguf_config_tensors]
    for t in tensors:
        _check_type(QType(t.tensor_type))
    names = {t.name: hf_name(t.name, spec) for t in tensors}
    types = {piece: QType(t.tensor_type) for t in tensors for piece, _, _ in unfused(spec, names[t.name], config)}

    def items() -> Iterator[tuple[str, GGUFTensor]]:
        for t in tensors:
            whole = checkpoint_tensor(t.data, QType(t.tensor_type), tensor_shape(t))
            for name, start, rows in unfused(spec, names[t.name], config):
                weight = whole if rows < 0 else whole.narrow(0, start, rows)
                if permuted and ".self_attn.q_proj." in name:
                    weight = unpermute_qk(weight, config.num_heads)
                elif permuted and ".self_attn.k_proj." in name:
                    weight = unpermute_qk(weight, config.num_kv_heads)
                yield name, weight

    return config, types, items()


def load_gguf(path: Path, dtype: torch.dtype = torch.float32) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Config and dequantized state dict (Hugging Face names, ``dtype``, on CPU) of a GGUF checkpoint;
    tied checkpoints get no ``lm_head.weight`` entry. The server loads through ``iter_gguf`` instead."""
    config, _, items = iter_gguf(path)
    state = {}
    for name, weight in items:
        state[name] = (weight.dequantize() if isinstance(weight, GGUFBlocks) else weight).to(dtype)
    return config, state


__all__ = [
    "SUPPORTED_TENSOR_TYPES",
    "GGUFError",
    "dequantize",
    "dequantize_tensor",
    "hf_name",
    "iter_gguf",
    "load_gguf",
    "open_gguf",
    "read_config",
    "tensor_shape",
    "unpermute_index",
    "unpermute_qk",
]
