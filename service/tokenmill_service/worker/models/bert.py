"""A BERT encoder (transformers' ``BertModel``: bge-small, all-MiniLM, e5), for embeddings, as a plain ``nn.Module``.

Bidirectional attention over one text at a time; absolute position and token-type embeddings (every token is
type 0, as a single text is); each sub-layer's output added to its input and then LayerNorm-ed (post-norm);
GELU in the feed-forward block. The forward pass returns every token's last hidden state in float32, which
the embedder pools (engine/embedder.py). Encoders are small: weights are float32, whatever the checkpoint
stores (a GGUF's quantized tensors are dequantized as they are read).

Read from a Hugging Face directory (``config.json`` + safetensors, tensors under transformers' names, with or
without the ``bert.`` prefix of the pre-training heads' checkpoints) or a GGUF file of llama.cpp's ``bert``
architecture (its tensor names below).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from tokenmill_service.contract.model_dims import is_gguf
from tokenmill_service.contract.model_paths import ModelLoadError

# transformers' names -> the model's, outside the layers and in layer N (``encoder.layer.N.<part>``).
HF_NAMES = {
    "embeddings.word_embeddings": "word_embeddings",
    "embeddings.position_embeddings": "position_embeddings",
    "embeddings.token_type_embeddings": "token_type_embeddings",
    "embeddings.LayerNorm": "embeddings_norm",
}
HF_LAYER_NAMES = {
    "attention.self.query": "query",
    "attention.self.key": "key",
    "attention.self.value": "value",
    "attention.output.dense": "attention_output",
    "attention.output.LayerNorm": "attention_norm",
    "intermediate.dense": "intermediate",
    "output.dense": "output",
    "output.LayerNorm": "output_norm",
}
# Tensors an embedding does not use: the pooler, the pre-training heads, a buffer older checkpoints saved.
_HF_UNUSED = re.compile(r"(bert\.)?(pooler\.|cls\.|embeddings\.position_ids)")
# llama.cpp's names (convert_hf_to_gguf.py's BertModel) -> the model's.
GGUF_NAMES = {
    "token_embd": "word_embeddings",
    "position_embd": "position_embeddings",
    "token_types": "token_type_embeddings",
    "token_embd_norm": "embeddings_norm",
}
GGUF_LAYER_NAMES = {
    "attn_q": "query",
    "attn_k": "key",
    "attn_v": "value",
    "attn_output": "attention_output",
    "attn_output_norm": "attention_norm",
    "ffn_up": "intermediate",
    "ffn_down": "output",
    "layer_output_norm": "output_norm",
}
_HF_LAYER = re.compile(r"encoder\.layer\.(\d+)\.(.+)\.(weight|bias)")
_GGUF_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# config.json's hidden_act -> the GELU it means (transformers' ACT2FN).
_ACTIVATIONS = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}


class BertLoadError(ModelLoadError):
    """The checkpoint is not a BERT encoder this service can run."""


@dataclass(frozen=True, slots=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    max_position_embeddings: int
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    gelu_approximate: str = "none"  # "tanh": gelu_new
    name: str = "bert"


class BertLayer(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.layer_norm_eps
        self.num_heads = config.num_heads
        self.gelu_approximate = config.gelu_approximate
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)
        self.attention_output = nn.Linear(hidden, hidden)
        self.attention_norm = nn.LayerNorm(hidden, eps)
        self.intermediate = nn.Linear(hidden, config.intermediate_size)
        self.output = nn.Linear(config.intermediate_size, hidden)
        self.output_norm = nn.LayerNorm(hidden, eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens, hidden = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [heads, T, head_dim]
            return t.view(tokens, self.num_heads, hidden // self.num_heads).transpose(0, 1)

        attended = F.scaled_dot_product_attention(heads(self.query(x)), heads(self.key(x)), heads(self.value(x)))
        x = self.attention_norm(self.attention_output(attended.transpose(0, 1).reshape(tokens, hidden)) + x)
        inner = F.gelu(self.intermediate(x), approximate=self.gelu_approximate)
        out: torch.Tensor = self.output_norm(self.output(inner) + x)
        return out


class BertEncoder(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, hidden)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, hidden)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, hidden)
        self.embeddings_norm = nn.LayerNorm(hidden, config.layer_norm_eps)
        self.layers = nn.ModuleList(BertLayer(config) for _ in range(config.num_layers))

    @property
    def device(self) -> torch.device:
        return self.word_embeddings.weight.device

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """One text's ids [T] -> its tokens' last hidden states [T, hidden], float32."""
        positions = torch.arange(input_ids.shape[0], device=input_ids.device)
        x: torch.Tensor = self.word_embeddings(input_ids) + self.token_type_embeddings(torch.zeros_like(input_ids))
        x = self.embeddings_norm(x + self.position_embeddings(positions))
        for layer in self.layers:
            x = layer(x)
        return x


# -- loading -------------------------------------------------------------------------------------


def load_bert(path: Path, device: str = "cpu") -> BertEncoder:
    """The encoder at ``path`` (a Hugging Face directory or a GGUF file), on ``device``, in eval mode."""
    config, tensors = _read_gguf(path) if is_gguf(path) else _read_hf(path)
    with torch.device("meta"):
        model = BertEncoder(config)
    state = dict(tensors)
    expected = set(model.state_dict())
    missing, unknown = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unknown:
        raise BertLoadError(f"{path}: the checkpoint lacks {missing[:8]} and has no place for {unknown[:8]}")
    model.load_state_dict(state, assign=True)
    return model.to(device).eval()


def _read_hf(root: Path) -> tuple[BertConfig, Iterator[tuple[str, torch.Tensor]]]:
    raw = json.loads((root / "config.json").read_text())
    act = raw.get("hidden_act", "gelu")
    if act not in _ACTIVATIONS:
        raise BertLoadError(f"{root / 'config.json'}: hidden_act {act!r} is not supported (supported: gelu, gelu_new)")
    if raw.get("position_embedding_type", "absolute") != "absolute":
        raise BertLoadError(
            f"{root / 'config.json'}: position_embedding_type {raw['position_embedding_type']!r} is "
            "not supported (only absolute)"
        )
    config = BertConfig(
        vocab_size=int(raw["vocab_size"]),
        hidden_size=int(raw["hidden_size"]),
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=int(raw["num_attention_heads"]),
        max_position_embeddings=int(raw.get("max_position_embeddings", 512)),
        type_vocab_size=int(raw.get("type_vocab_size", 2)),
        layer_norm_eps=float(raw.get("layer_norm_eps", 1e-12)),
        gelu_approximate=_ACTIVATIONS[act],
        name=root.resolve().name,
    )
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise BertLoadError(f"{root}: no safetensors weights (pickled weights are never loaded)")

    def items() -> Iterator[tuple[str, torch.Tensor]]:
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open has keys() but is not iterable
                    if _HF_UNUSED.match(name):
                        continue
                    yield _hf_name(name), f.get_tensor(name).float()

    return config, items()


def _hf_name(name: str) -> str:
    name = name.removeprefix("bert.")
    module, _, kind = name.rpartition(".")
    kind = {"gamma": "weight", "beta": "bias"}.get(kind, kind)  # (older checkpoints' LayerNorm names)
    if module in HF_NAMES:
        return f"{HF_NAMES[module]}.{kind}"
    match = _HF_LAYER.fullmatch(f"{module}.{kind}")
    if match and match.group(2) in HF_LAYER_NAMES:
        return f"layers.{match.group(1)}.{HF_LAYER_NAMES[match.group(2)]}.{kind}"
    return name  # no place in the model: load_bert names it


def _read_gguf(path: Path) -> tuple[BertConfig, Iterator[tuple[str, torch.Tensor]]]:
    from tokenmill_service.contract.gguf_reader import open_gguf
    from tokenmill_service.worker.models.gguf_loader import dequantize_tensor

    reader = open_gguf(path)

    def field(key: str) -> object:
        found = reader.get_field(key)
        if found is None:
            raise BertLoadError(f"{path}: GGUF metadata lacks {key!r}")
        return found.contents()

    shapes = {t.name: [int(n) for n in t.shape] for t in reader.tensors}
    hidden = int(str(field("bert.embedding_length")))
    config = BertConfig(
        vocab_size=shapes["token_embd.weight"][1],
        hidden_size=hidden,
        intermediate_size=int(str(field("bert.feed_forward_length"))),
        num_layers=int(str(field("bert.block_count"))),
        num_heads=int(str(field("bert.attention.head_count"))),
        max_position_embeddings=int(str(field("bert.context_length"))),
        type_vocab_size=shapes["token_types.weight"][1] if "token_types.weight" in shapes else 2,
        layer_norm_eps=float(str(field("bert.attention.layer_norm_epsilon"))),
        name=path.name.removesuffix(".gguf"),
    )

    def items() -> Iterator[tuple[str, torch.Tensor]]:
        for t in reader.tensors:
            weight = dequantize_tensor(t)
            match = _GGUF_LAYER.fullmatch(t.name)
            if match and match.group(2) == "attn_qkv":  # q, k and v fused in one tensor: rows in that order
                for part, rows in zip(("query", "key", "value"), torch.split(weight, hidden)):
                    yield f"layers.{match.group(1)}.{part}.{match.group(3)}", rows
                continue
            yield _gguf_name(t.name), weight

    return config, items()


def _gguf_name(name: str) -> str:
    module, _, kind = name.rpartition(".")
    if module in GGUF_NAMES:
        return f"{GGUF_NAMES[module]}.{kind}"
    match = _GGUF_LAYER.fullmatch(name)
    if match and match.group(2) in GGUF_LAYER_NAMES:
        return f"layers.{match.group(1)}.{GGUF_LAYER_NAMES[match.group(2)]}.{kind}"
    return name
