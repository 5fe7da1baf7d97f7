"""A Gemma-style SentencePiece vocabulary, from a GGUF and from a Hugging Face tokenizer.json, exact against
Hugging Face ``tokenizers`` and transformers on the multilingual text set of test_sentencepiece.py.

Gemma's vocabulary cannot be downloaded here, so one with Gemma's conventions is trained in the test
(BPE over the corpus, laid out as a SentencePiece model) and written as Gemma's files are:

- no dummy prefix: llama.cpp's converter writes ``tokenizer.ggml.add_space_prefix = false`` for Gemma,
  and Gemma's tokenizer.json normalizes with a bare ``Replace(" ", "▁")`` (no ``Prepend``), no
  pre-tokenizer, and decodes with Replace, ByteFallback, Fuse and no ``Strip``: leading spaces stay;
- its special ids: ``<pad>`` 0, ``<eos>`` 1, ``<bos>`` 2, ``<unk>`` 3, BOS added; ``<start_of_turn>`` /
  ``<end_of_turn>`` control tokens and Gemma's chat template;
- pieces of runs of spaces, tabs and newlines (Gemma's vocabulary holds ``▁▁`` .. and ``\\n\\n``), byte
  fallback for what has no piece.

What it proves: our GGUF reader and our tokenizer.json reader both give, for every text, the ids that
Hugging Face ``tokenizers`` gives on the tokenizer.json, that transformers' AutoTokenizer gives, and that
llama.cpp's SPM algorithm gives without the space prefix; decoding gives the text back (spaces and all),
and a chat encodes as transformers' ``apply_chat_template`` does. It does not prove the real Gemma
vocabulary's own pieces or scores (which only the real files hold), only that its conventions are read
as Hugging Face and llama.cpp read them.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as HFTokenizer

from tests.unit.test_sentencepiece import (
    BYTE,
    CONTROL,
    CORPUS,
    NORMAL,
    SPACE,
    TEXTS,
    UNKNOWN,
    Vocabulary,
    _llama_cpp_spm,
    _random_texts,
)
from tokenmill_service.contract.tokenizer import Tokenizer, load_tokenizer

GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + m['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
WHITESPACE_PIECES = [SPACE * n for n in range(2, 9)] + ["\n\n", "\n\n\n", "\t\t"]


def _gemma_vocabulary() -> Vocabulary:
    """BPE trained on the corpus with Gemma's normalizer (spaces to ▁, none put in front), laid out as
    Gemma's SentencePiece model: <pad>, <eos>, <bos>, <unk>, the chat tokens, the 256 byte tokens, the
    whitespace runs, the merged pieces, then single characters (scores falling in that order)."""
    trainer_tokenizer = HFTokenizer(models.BPE())
    trainer_tokenizer.normalizer = normalizers.Replace(" ", SPACE)
    trainer_tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never", split=True)
    trainer = trainers.BpeTrainer(vocab_size=700, limit_alphabet=150, show_progress=False)
    trainer_tokenizer.train_from_iterator(CORPUS * 3, trainer)
    model = json.loads(trainer_tokenizer.to_str())["model"]
    merged = [p for p in dict.fromkeys(left + right for left, right in model["merges"]) if p not in WHITESPACE_PIECES]
    chars = sorted({*(t for t in model["vocab"] if len(t) == 1), SPACE, "\n", "\t"})
    pieces = [*WHITESPACE_PIECES, *merged, *chars]
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    tokens = [*specials, *[f"<0x{b:02X}>" for b in range(256)], *pieces]
    types = [CONTROL, CONTROL, CONTROL, UNKNOWN, CONTROL, CONTROL, *[BYTE] * 256, *[NORMAL] * len(pieces)]
    scores = [0.0] * (len(specials) + 256) + [-float(i) for i in range(len(pieces))]
    assert all(c in tokens for piece in pieces for c in piece)  # SentencePiece's invariant
    return Vocabulary(tokens, scores, types)


def _write_gguf(path: Path, vocab: Vocabulary) -> Path:
    """The vocabulary under llama.cpp's keys, as convert_hf_to_gguf.py writes Gemma's (GemmaModel.set_vocab)."""
    writer = gguf.GGUFWriter(str(path), arch="gemma2")
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(vocab.tokens)
    writer.add_token_scores(vocab.scores)
    writer.add_token_types(vocab.types)
    writer.add_pad_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_bos_token_id(2)
    writer.add_unk_token_id(3)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(False)
    writer.add_chat_template(GEMMA_TEMPLATE)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


def _write_hf_dir(path: Path, vocab: Vocabulary) -> Path:
    """Gemma's tokenizer.json form: BPE with byte fallback and merges from the scores, Replace normalizer,
    no pre-tokenizer, a decoder without Strip, ``<bos> $A``; tokenizer_config.json with its chat template."""
    from transformers.tokenization_utils_base import generate_merges

    ids = {t: i for i, t in enumerate(vocab.tokens)}
    merges = generate_merges(ids, dict(zip(vocab.tokens, vocab.scores)))
    hf = HFTokenizer(models.BPE(vocab=ids, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    hf.normalizer = normalizers.Replace(" ", SPACE)
    hf.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    hf.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", 2)]
    )
    hf.add_special_tokens(
        [AddedToken(t, normalized=False, special=True) for t, k in zip(vocab.tokens, vocab.types) if k in (2, 3)]
    )
    path.mkdir()
    hf.save(str(path / "tokenizer.json"))
    config = {
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "unk_token": "<unk>",
        "pad_token": "<pad>",
        "add_bos_token": True,
        "add_eos_token": False,
        "chat_template": GEMMA_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def vocab() -> Vocabulary:
    return _gemma_vocabulary()


@pytest.fixture(scope="module")
def files(vocab: Vocabulary, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("gemma-vocab")
    return _write_gguf(root / "gemma.gguf", vocab), _write_hf_dir(root / "gemma-hf", vocab)


@pytest.fixture(scope="module", params=["gguf", "hf"])
def tok(request: pytest.FixtureRequest, files: tuple[Path, Path]) -> Tokenizer:
    return load_tokenizer(files[0] if request.param == "gguf" else files[1])


def test_ids_are_hugging_faces_transformers_and_llama_cpps(
    tok: Tokenizer, files: tuple[Path, Path], vocab: Vocabulary
) -> None:
    from transformers import AutoTokenizer

    oracle = HFTokenizer.from_file(str(files[1] / "tokenizer.json"))
    oracle.encode_special_tokens = True  # special-token text in the input is text
    reference = AutoTokenizer.from_pretrained(files[1])
    for text in [*TEXTS, *_random_texts(100, seed=11)]:
        ids = tok.encode(text)
        assert ids == oracle.encode(text, add_special_tokens=False).ids, repr(text)
        assert ids == _llama_cpp_spm(vocab, text, add_space_prefix=False), repr(text)
        assert ids == reference.encode(text, add_special_tokens=False, split_special_tokens=True), repr(text)
    assert reference.encode("Hello") == [2, *tok.encode("Hello")]
    assert (tok.bos_token_id, tok.eos_token_id, tok.add_bos) == (2, 1, True)


def test_the_vocabulary_exercises_whitespace_runs_and_byte_fallback(tok: Tokenizer, vocab: Vocabulary) -> None:
    ids = [i for text in TEXTS for i in tok.encode(text)]
    assert any(vocab.types[i] == BYTE for i in ids)
    assert {vocab.id_of(SPACE * 4), vocab.id_of("\n\n\n")} <= set(ids)
    # No dummy prefix: text that starts with a word gets no ▁, and leading spaces are kept as they are.
    assert not tok.token_text(tok.encode("the forest")[0]).startswith(" ")
    assert tok.token_text(tok.encode(" the forest")[0]).startswith(" ")
    assert b"".join(map(tok.token_bytes, tok.encode("  hi"))) == b"  hi"


def test_decoding_gives_the_text_and_hugging_faces_decode(tok: Tokenizer, files: tuple[Path, Path]) -> None:
    oracle = HFTokenizer.from_file(str(files[1] / "tokenizer.json"))
    for text in [*(t for t in TEXTS if SPACE not in t), *_random_texts(200, seed=12)]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text == oracle.decode(ids, skip_special_tokens=False), repr(text)


def test_a_chat_encodes_as_transformers_chat_template(tok: Tokenizer, files: tuple[Path, Path]) -> None:
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(files[1])
    messages = [
        {"role": "user", "content": "What is the forest like?"},
        {"role": "assistant", "content": "Quiet. Très calme. 静か 🚀"},
        {"role": "user", "content": "And the fox?\n  def f(x):\n\treturn x"},
    ]
    rendered = tok.render_chat(messages, add_generation_prompt=True)
    assert rendered.startswith("<bos><start_of_turn>user\nWhat is the forest like?<end_of_turn>\n")
    assert rendered.endswith("<start_of_turn>model\n")
    want = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
    assert tok.encode_chat(messages, add_generation_prompt=True) == list(want)
