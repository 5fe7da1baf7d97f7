"""The tokenizer described by a GGUF file's ``tokenizer.*`` metadata (llama.cpp's keys and token types)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import structlog

from tokenmill_service.contract.gguf_reader import open_gguf
from tokenmill_service.contract.tokenizer.byte_level import (
    DEEPSEEK_CODER_SPLITS,
    DEEPSEEK_LLM_SPLITS,
    DEEPSEEK_V3_SPLITS,
    FALCON_SPLITS,
    GPT2_INDIVIDUAL_DIGITS_PATTERN,
    GPT2_PATTERN,
    LLAMA3_PATTERN,
    QWEN2_PATTERN,
    QWEN35_PATTERN,
    WHOLE_PIECE_PATTERN,
    SplitEncoding,
    build_bpe_encoding,
)
from tokenmill_service.contract.tokenizer.sentencepiece import sentencepiece_from_gguf
from tokenmill_service.contract.tokenizer.tokenizer import Tokenizer, TokenizerError
from tokenmill_service.contract.tokenizer.wordpiece import wordpiece_from_gguf

log = structlog.get_logger(__name__)

# llama.cpp's `tokenizer.ggml.pre` names whose pre-tokenizer is one of the byte-level patterns (its own
# table, llama-vocab.cpp, groups the names by pre-tokenizer; the names here use the same regex).
GGUF_PRE_PATTERNS: dict[str, str] = {
    **dict.fromkeys(
        ("gpt-2", "mpt", "olmo", "phi-2", "jina-es", "jina-de", "jina-v2-es", "jina-v2-de", "gigachat", "a.x-4.0"),
        GPT2_PATTERN,
    ),
    **dict.fromkeys(("mellum", "modern-bert", "exaone4", "jais", "trillion", "granite-docling"), GPT2_PATTERN),
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b", "mellum2"),
        GPT2_INDIVIDUAL_DIGITS_PATTERN,
    ),
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "dbrx", "smaug-bpe"),
        LLAMA3_PATTERN,
    ),
    **dict.fromkeys(
        ("qwen2", "deepseek-r1-qwen", "stablelm2", "hunyuan", "megrez", "kormo", "f2llmv2", "solar-open"), QWEN2_PATTERN
    ),
    "qwen35": QWEN35_PATTERN,
}
# Names whose pre-tokenizer is a list of regexes applied in turn (byte_level.SplitEncoding).
GGUF_PRE_SPLITS: dict[str, tuple[str, ...]] = {
    "deepseek-llm": DEEPSEEK_LLM_SPLITS,
    "deepseek-coder": DEEPSEEK_CODER_SPLITS,
    "deepseek-v3": DEEPSEEK_V3_SPLITS,
    "falcon": FALCON_SPLITS,
}

# GGUF token types (llama.cpp's llama_token_type).
_GGUF_NORMAL, _GGUF_USER_DEFINED = 1, 4


# A GGUF metadata value by key; None where the file lacks the key.
GgufField = Callable[[str], Any]


def tokenizer_from_gguf(path: str | Path, reader: gguf.GGUFReader | None = None) -> Tokenizer:
    """The tokenizer described by a GGUF file's ``tokenizer.*`` metadata (``reader``: the file already open)."""
    start = time.perf_counter()
    reader = reader if reader is not None else open_gguf(Path(path))

    def field(key: str) -> Any:
        found = reader.get_field(key)
        return None if found is None else found.contents()

    model = field("tokenizer.ggml.model")
    build = GGUF_TOKENIZER_KINDS.get(model)
    if build is None:
        known = ", ".join(sorted(GGUF_TOKENIZER_KINDS))
        raise TokenizerError(f"GGUF tokenizer model {model!r} is not supported (supported: {known})")
    tokenizer = build(Path(path).stem, field)
    pre = field("tokenizer.ggml.pre") or "default"
    seconds = round(time.perf_counter() - start, 3)
    log.info("tokenizer_loaded", source=str(path), pre=pre, vocab_size=tokenizer.vocab_size, seconds=seconds)
    return tokenizer


def _byte_level_bpe(name: str, field: GgufField) -> Tokenizer:
    """``tokenizer.ggml.model == "gpt2"``: byte-level BPE, its pre-tokenizer named by ``tokenizer.ggml.pre``."""
    pre = field("tokenizer.ggml.pre") or "default"
    splits = GGUF_PRE_SPLITS.get(pre)
    pattern = WHOLE_PIECE_PATTERN if splits else GGUF_PRE_PATTERNS.get(pre)
    if pattern is None:
        known = ", ".join(sorted([*GGUF_PRE_PATTERNS, *GGUF_PRE_SPLITS]))
        raise TokenizerError(f"GGUF pre-tokenizer {pre!r} is not supported (supported: {known})")
    tokens: list[str] = field("tokenizer.ggml.tokens")
    merges: list[str] | None = field("tokenizer.ggml.merges")
    if tokens is None or merges is None:
        raise TokenizerError("GGUF metadata lacks tokenizer.ggml.tokens or tokenizer.ggml.merges")
    types: list[int] = field("tokenizer.ggml.token_type") or [_GGUF_NORMAL] * len(tokens)
    eos = field("tokenizer.ggml.eos_token_id")
    if eos is None:
        raise TokenizerError("GGUF metadata lacks tokenizer.ggml.eos_token_id")
    bos = field("tokenizer.ggml.bos_token_id")

    bpe = {i: t for i, (t, kind) in enumerate(zip(tokens, types)) if kind == _GGUF_NORMAL}
    special = {t: i for i, (t, kind) in enumerate(zip(tokens, types)) if kind not in (_GGUF_NORMAL, _GGUF_USER_DEFINED)}
    added = {t: i for i, (t, kind) in enumerate(zip(tokens, types)) if kind == _GGUF_USER_DEFINED}
    pairs = (tuple(m.split(" ", 1)) for m in merges)
    encoding, num_ids = build_bpe_encoding(name, pattern, bpe, pairs, {**special, **added})  # type: ignore[arg-type]
    return Tokenizer(
        SplitEncoding(encoding, splits) if splits else encoding,
        vocab_size=max(num_ids, len(tokens)),
        special_tokens=special,
        added_tokens=added,
        eos_token_id=int(eos),
        bos_token_id=None if bos is None else int(bos),
        add_bos=bool(field("tokenizer.ggml.add_bos_token")),
        chat_template=field("tokenizer.chat_template"),
    )


# What builds the tokenizer for each `tokenizer.ggml.model`, from the file's name and its metadata:
# a new kind is one entry here.
GGUF_TOKENIZER_KINDS: dict[str, Callable[[str, GgufField], Tokenizer]] = {
    "gpt2": _byte_level_bpe,
    "llama": sentencepiece_from_gguf,  # SentencePiece (Llama 2, Mistral, TinyLlama, Phi-3)
    "bert": wordpiece_from_gguf,  # WordPiece (BERT encoders: bge, all-MiniLM)
}
