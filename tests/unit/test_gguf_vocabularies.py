"""The tokenizers of real models' GGUF files against the token ids their reference tokenizers give.

llama.cpp keeps, for its own tokenizer tests, vocabulary-only GGUFs of real models (Llama 3's
``llama-bpe``, Qwen2, Qwen3.5, GPT-2, StarCoder, Refact, DeepSeek LLM and Coder, Falcon; Llama 2's and Phi-3's SentencePiece) with a set of
texts (multilingual, whitespace runs, digits, emoji, code) and the ids Hugging Face's tokenizer gives
for each. ``make tools`` fetches them from the llama-cpp-python sdist on PyPI into .tools/vocab/."""

from __future__ import annotations

from pathlib import Path

import pytest
import regex

from tokenmill_service.contract.tokenizer.byte_level import DEEPSEEK_V3_SPLITS, split_pieces
from tokenmill_service.contract.tokenizer.gguf import tokenizer_from_gguf

VOCAB = Path(__file__).parents[2] / ".tools" / "vocab"
SEPARATOR = "\n__ggml_vocab_test__\n"
# tokenizer.ggml.model gpt2 (byte-level BPE, by pre-tokenizer) and llama (SentencePiece).
BYTE_LEVEL = ["gpt-2", "llama-bpe", "qwen2", "qwen35", "refact", "starcoder"]
# Byte-level BPE whose pre-tokenizer is several regexes applied in turn (byte_level.SplitEncoding).
SPLIT = ["deepseek-llm", "deepseek-coder", "falcon"]
VOCABULARIES = [*BYTE_LEVEL, *SPLIT, "llama-spm", "phi-3"]


def _cases(name: str) -> list[tuple[str, list[int]]]:
    path = VOCAB / f"ggml-vocab-{name}.gguf"
    if not path.with_suffix(".gguf.out").is_file():
        pytest.fail(f"{path} is missing: run `make tools` (bash scripts/install_tools.sh)")
    texts = path.with_suffix(".gguf.inp").read_text(encoding="utf-8").split(SEPARATOR)
    ids = [[int(t) for t in line.split()] for line in path.with_suffix(".gguf.out").read_text().split("\n")]
    assert len(texts) == len(ids) > 40
    return list(zip(texts, ids))


@pytest.mark.parametrize("name", VOCABULARIES)
def test_every_text_encodes_to_the_reference_ids_and_back(name: str) -> None:
    tokenizer = tokenizer_from_gguf(VOCAB / f"ggml-vocab-{name}.gguf")
    cases = _cases(name)
    wrong = [(text, tokenizer.encode(text), ids) for text, ids in cases if tokenizer.encode(text) != ids]
    assert not wrong, f"{len(wrong)} of {len(cases)} differ, first: {wrong[0]}"
    assert any(not text.isascii() for text, _ in cases)  # the set is multilingual
    if name in BYTE_LEVEL + SPLIT:  # byte-level BPE loses nothing; SentencePiece normalizes spaces
        assert [tokenizer.decode(ids) for _, ids in cases] == [text for text, _ in cases]


def test_deepseek_v3s_pre_tokenizer_splits_digits_in_threes_cjk_runs_then_words() -> None:
    """DeepSeek-V3's three regexes in turn (no vocabulary of it ships with llama.cpp's tests): digit runs
    in threes, then CJK runs, then its word pattern inside what is left."""
    splits = [regex.compile(p) for p in DEEPSEEK_V3_SPLITS]
    assert split_pieces("abc 12345 中文测试 hello!  \n\nthe end", splits) == [
        *("abc", " ", "123", "45", " ", "中文测试", " hello", "!", "  \n\n", "the", " end")
    ]
