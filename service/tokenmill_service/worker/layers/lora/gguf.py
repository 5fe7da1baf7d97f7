"""LoRA adapters as llama.cpp writes them (``convert_lora_to_gguf.py``): one GGUF file with
``general.type = adapter``, ``adapter.type = lora``, ``adapter.lora.alpha``, and for each targeted
projection ``blk.N.<part>.weight.lora_a`` [r, in] and ``.lora_b`` [out, r].

llama.cpp scales by ``alpha / r`` (no rsLoRA in the file). Its converter permutes the rows of
``attn_q`` and ``attn_k``'s B for ggml's pairwise RoPE, as it does the base weights of the "llama"
architecture; they are put back in Hugging Face's order here, where the model's weights are.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

# llama.cpp's part names -> the Hugging Face projection.
PARTS = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}  # fmt: skip
# Architectures whose q/k rows llama.cpp's converter permutes (as worker/models/llama.py's gguf_permuted).
PERMUTED = frozenset({"llama", "mistral"})


def is_gguf(path: str | Path) -> bool:
    p = Path(path)
    if not p.is_file():
        return False
    with open(p, "rb") as f:
        return f.read(4) == b"GGUF"


def _field(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def read_gguf(path: str | Path) -> tuple[dict[str, Any], dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """The file's metadata (type, adapter type, alpha, architecture) and each projection's (A, B) as
    float32, by checkpoint name, B of q and k in Hugging Face's row order (``unpermute`` needs the heads)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    meta = {
        "type": _field(reader, "general.type"),
        "adapter_type": _field(reader, "adapter.type"),
        "alpha": _field(reader, "adapter.lora.alpha"),
        "architecture": _field(reader, "general.architecture"),
    }
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for t in reader.tensors:
        stem, _, which = t.name.rpartition(".")
        parts = stem.split(".")
        if which not in ("lora_a", "lora_b") or len(parts) != 4 or parts[0] != "blk" or parts[2] not in PARTS:
            raise ValueError(f"tensor {t.name!r} targets no servable projection")
        data = gguf.quants.dequantize(t.data, t.tensor_type)
        array = np.asarray(data, dtype=np.float32).reshape([int(n) for n in reversed(t.shape)])
        module = f"model.layers.{parts[1]}.{PARTS[parts[2]]}"
        pairs.setdefault(module, {})[which] = torch.from_numpy(array.copy())
    out = {}
    for module, ab in pairs.items():
        if set(ab) != {"lora_a", "lora_b"}:
            raise ValueError(f"{module} has lora_a without lora_b (or the reverse)")
        out[module] = (ab["lora_a"], ab["lora_b"])
    return meta, out


def unpermute(b: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's ``permute`` of q/k rows (per head it laid (2, half) out as (half, 2))."""
    rows = b.shape[0]
    return b.reshape(num_heads, rows // num_heads // 2, 2, *b.shape[1:]).transpose(1, 2).reshape(b.shape)
