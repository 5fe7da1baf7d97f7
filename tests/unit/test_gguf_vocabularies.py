"""The tokenizers of real models' GGUF files against the token ids their reference tokenizers give.

llama.cpp keeps, for its own tokenizer tests, vocabulary-only GGUFs of real models (Llama 3's
``llama-bpe``, Qwen2, Qwen3.5, GPT-2, StarCoder, Refact; Llama 2's and Phi-3's SentencePiece) with a set of
texts (multilingual, whitespace runs, digits, emoji, code) and the ids Hugging Face's tokenizer gives
for each. ``make tools`` fetches them from the llama-cpp-python sdist on PyPI into .tools/vocab/."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenmill_service.tokenizer.gguf import tokenizer_from_gguf

VOCAB = Path(__file__).parents[2] / ".tools" / "vocab"
SEPARATOR = "\n__ggml_vocab_test__\n"
# tokenizer.ggml.model gpt2 (byte-level BPE, by pre-tokenizer) and llama (SentencePiece).
BYTE_LEVEL = ["gpt-2", "llama-bpe", "qwen2", "qwen35", "refact", "starcoder"]
VOCABULARIES = [*BYTE_LEVEL, "llama-spm", "phi-3"]


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
    if name in BYTE_LEVEL:  # byte-level BPE loses nothing; SentencePiece normalizes spaces
        assert [tokenizer.decode(ids) for _, ids in cases] == [text for text, _ in cases]
