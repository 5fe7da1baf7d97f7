"""Tiny random embedding models made here (never downloaded), with sentence-transformers over the same weights as
the reference: a BERT with a WordPiece vocabulary (mean or CLS pooling, normalized), the same BERT written to a
GGUF file as llama.cpp's converter writes it, and a Qwen3 decoder with last-token pooling (padding on the left,
EOS after each text, as Qwen3-Embedding)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from tests.tiny_checkpoint import sharpen, write_byte_level_tokenizer

WORDS = ["the", "cat", "dog", "sat", "on", "mat", "hello", "world", "paris", "france", "capital", "is", "of", "a"]
VOCAB = [
    "[PAD]",
    "[UNK]",
    "[CLS]",
    "[SEP]",
    "[MASK]",
    *"abcdefghijklmnopqrstuvwxyz.,!?'",
    *WORDS,
    *("##" + s for s in ("s", "ing", "ed", "er", "ly", "e", "t", "a", "o")),
]
TEXTS = ["The cat sat on the mat.", "Hello, world!", "Paris is the capital of France", "dogs", "a"]


def write_tiny_bert(directory: Path) -> Path:
    """A BertModel (two layers, hidden 32, four heads) and its WordPiece tokenizer, transformers' layout."""
    import torch
    import transformers

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    transformers.BertTokenizerFast(vocab_file=str(directory / "vocab.txt")).save_pretrained(directory)
    (directory / "vocab.txt").unlink()  # the tokenizer.json is what is served
    config = transformers.BertConfig(
        vocab_size=len(VOCAB),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    sharpen(transformers.BertModel(config, add_pooling_layer=False)).save_pretrained(directory)
    return directory


def sentence_transformer(directory: Path, pooling: str, normalize: bool = True, **transformer: Any) -> Any:
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    module = Transformer(str(directory), **transformer)
    modules = [module, Pooling(module.get_embedding_dimension(), pooling_mode=pooling)]
    return SentenceTransformer(modules=[*modules, Normalize()] if normalize else modules, device="cpu")


def write_bert_gguf(directory: Path, path: Path, pooling_type: int) -> Path:
    """The BERT at ``directory`` as llama.cpp's converter (BertModel) writes it: tensors by its names, the vocabulary
    with a ▁ before word-initial tokens and without the ## of continuations, [CLS] as BOS."""
    import gguf
    from safetensors.numpy import load_file

    raw = json.loads((directory / "config.json").read_text())
    vocab: dict[str, int] = json.loads((directory / "tokenizer.json").read_text())["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    writer = gguf.GGUFWriter(str(path), "bert")
    writer.add_context_length(raw["max_position_embeddings"])
    writer.add_embedding_length(raw["hidden_size"])
    writer.add_feed_forward_length(raw["intermediate_size"])
    writer.add_block_count(raw["num_hidden_layers"])
    writer.add_head_count(raw["num_attention_heads"])
    writer.add_layer_norm_eps(raw["layer_norm_eps"])
    writer.add_causal_attention(False)
    writer.add_pooling_type(gguf.PoolingType(pooling_type))
    writer.add_tokenizer_model("bert")
    writer.add_token_list([t if t.startswith("[") else t[2:] if t.startswith("##") else "\u2581" + t for t in tokens])
    types = [gguf.TokenType.CONTROL if t.startswith("[") else gguf.TokenType.NORMAL for t in tokens]
    types[vocab["[UNK]"]] = gguf.TokenType.UNKNOWN
    writer.add_token_types(types)
    writer.add_token_type_count(raw["type_vocab_size"])
    writer.add_bos_token_id(vocab["[CLS]"])
    writer.add_sep_token_id(vocab["[SEP]"])
    writer.add_pad_token_id(vocab["[PAD]"])
    writer.add_unk_token_id(vocab["[UNK]"])
    names = {
        "embeddings.word_embeddings": "token_embd",
        "embeddings.position_embeddings": "position_embd",
        "embeddings.token_type_embeddings": "token_types",
        "embeddings.LayerNorm": "token_embd_norm",
    }
    parts = {
        "attention.self.query": "attn_q",
        "attention.self.key": "attn_k",
        "attention.self.value": "attn_v",
        "attention.output.dense": "attn_output",
        "attention.output.LayerNorm": "attn_output_norm",
        "intermediate.dense": "ffn_up",
        "output.dense": "ffn_down",
        "output.LayerNorm": "layer_output_norm",
    }
    for name, tensor in load_file(str(directory / "model.safetensors")).items():
        module, _, kind = name.rpartition(".")
        if module in names:
            target = names[module]
        else:
            _, _, layer, part = module.split(".", 3)
            target = f"blk.{layer}.{parts[part]}"
        writer.add_tensor(f"{target}.{kind}", np.ascontiguousarray(tensor, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_tiny_qwen3_embedding(directory: Path) -> tuple[Path, Any]:
    """A Qwen3 decoder saved by sentence-transformers with last-token pooling and Normalize, its tokenizer putting
    EOS after each text; returns the directory and the reference SentenceTransformer."""
    import tokenizers
    import torch
    import transformers

    source = directory.parent / (directory.name + "-source")
    source.mkdir(parents=True)
    write_byte_level_tokenizer(source)
    tok = tokenizers.Tokenizer.from_file(str(source / "tokenizer.json"))
    eos = tok.token_to_id("<|eos|>")
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single="$A <|eos|>", pair="$A <|eos|> $B <|eos|>", special_tokens=[("<|eos|>", eos)]
    )
    tok.save(str(source / "tokenizer.json"))
    (source / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|eos|>", "pad_token": "<|eos|>", "padding_side": "left"})
    )
    config = transformers.Qwen3Config(
        vocab_size=257,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    )
    torch.manual_seed(1)
    sharpen(transformers.Qwen3Model(config)).save_pretrained(source)
    model = sentence_transformer(source, "lasttoken")
    model.save(str(directory))
    return directory, model
