"""The tokenizer of a Hugging Face directory: ``tokenizer.json`` and its config files.

tokenizer.json describes its pipeline step by step (normalizer, pre-tokenizer, model, post-processor).
Byte-level BPE is read into the one regex and rank table of a tiktoken encoding; a SentencePiece kind
(BPE with byte fallback, or Unigram) is loaded by ``tokenizers`` itself (sentencepiece.py); anything
else is refused with a TokenizerError naming what is not supported.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import structlog

from tokenmill_service.contract.tokenizer.byte_level import (
    GPT2_DIGIT_RUNS_PATTERN,
    GPT2_INDIVIDUAL_DIGITS_PATTERN,
    GPT2_PATTERN,
    WHOLE_PIECE_PATTERN,
    SplitEncoding,
    build_bpe_encoding,
)
from tokenmill_service.contract.tokenizer.sentencepiece import sentencepiece_from_tokenizer_json
from tokenmill_service.contract.tokenizer.tokenizer import Encoding, Tokenizer, TokenizerError
from tokenmill_service.contract.tokenizer.wordpiece import wordpiece_from_tokenizer_json

log = structlog.get_logger(__name__)


class _Vocabulary(NamedTuple):
    """What a tokenizer.json reader gives the rest of the directory's reading."""

    encoding: Encoding
    special: dict[str, int]
    added: dict[str, int]
    id_of: Mapping[str, int]
    vocab_size: int
    nfc: bool


def tokenizer_from_hf_dir(path: str | Path) -> Tokenizer:
    """A Hugging Face directory with a byte-level BPE or SentencePiece ``tokenizer.json`` (and its config)."""
    start = time.perf_counter()
    root = Path(path)
    spec = _read_json(root / "tokenizer.json")
    if spec is None:
        raise TokenizerError(f"{root} has no tokenizer.json")
    config = _read_json(root / "tokenizer_config.json") or {}
    model = spec.get("model") or {}
    kind = model.get("type")
    if kind == "WordPiece":  # an encoder's (BERT's)
        return wordpiece_from_tokenizer_json(root / "tokenizer.json", config)
    if kind == "BPE" and not model.get("byte_fallback") and _uses_byte_level(spec):
        vocabulary = _byte_level(root.name, spec)
    elif kind in ("BPE", "Unigram"):
        encoding = sentencepiece_from_tokenizer_json(root / "tokenizer.json", spec)
        vocab = encoding.backend.get_vocab(with_added_tokens=True)
        vocabulary = _Vocabulary(
            encoding, encoding.special_tokens, encoding.added_tokens, vocab, encoding.num_ids, nfc=False
        )
    else:
        raise TokenizerError(
            f"tokenizer model {kind!r} is not supported; only byte-level BPE, SentencePiece's BPE with byte "
            "fallback or Unigram, and WordPiece"
        )

    id_of = vocabulary.id_of
    eos_text = _token_text(config.get("eos_token"))
    if eos_text is None or eos_text not in id_of:
        raise TokenizerError(f"{root}: tokenizer_config.json names no eos_token in the vocabulary ({eos_text!r})")
    bos_text = _token_text(config.get("bos_token"))
    bos_id = id_of.get(bos_text) if bos_text is not None else None
    add_bos = config.get("add_bos_token")
    if add_bos is None:
        add_bos = bos_text is not None and _post_processor_adds(spec.get("post_processor"), bos_text)
    generation = _read_json(root / "generation_config.json") or {}
    extra_eos = generation.get("eos_token_id")
    extra_eos = [] if extra_eos is None else [extra_eos] if isinstance(extra_eos, int) else list(extra_eos)

    tokenizer = Tokenizer(
        vocabulary.encoding,
        vocab_size=vocabulary.vocab_size,
        special_tokens=vocabulary.special,
        added_tokens=vocabulary.added,
        eos_token_id=id_of[eos_text],
        bos_token_id=bos_id,
        add_bos=bool(add_bos),
        chat_template=_chat_template(root, config),
        nfc=vocabulary.nfc,
        extra_stop_ids=(int(i) for i in extra_eos),
    )
    seconds = round(time.perf_counter() - start, 3)
    log.info("tokenizer_loaded", source=str(root), model=kind, vocab_size=tokenizer.vocab_size, seconds=seconds)
    return tokenizer


def _uses_byte_level(spec: Mapping[str, Any]) -> bool:
    """Whether the pre-tokenizer or the decoder works on GPT-2's byte alphabet."""
    for step in (spec.get("pre_tokenizer"), spec.get("decoder")):
        steps = list(step.get("pretokenizers") or step.get("decoders") or [step]) if step else []
        if any(s.get("type") == "ByteLevel" for s in steps):
            return True
    return False


def _byte_level(name: str, spec: Mapping[str, Any]) -> _Vocabulary:
    """A byte-level BPE tokenizer.json as a tiktoken encoding."""
    model = spec["model"]
    nfc = _normalizer_is_nfc(spec.get("normalizer"))
    pattern, splits = _pattern(spec.get("pre_tokenizer"))
    added_specs = spec.get("added_tokens") or []
    special = {a["content"]: int(a["id"]) for a in added_specs if a.get("special", True)}
    added = {a["content"]: int(a["id"]) for a in added_specs if not a.get("special", True)}
    added_ids = {*special.values(), *added.values()}
    bpe = {int(i): t for t, i in model["vocab"].items() if int(i) not in added_ids}
    pairs = (tuple(m.split(" ", 1)) if isinstance(m, str) else (m[0], m[1]) for m in model.get("merges", []))
    encoding, num_ids = build_bpe_encoding(name, pattern, bpe, pairs, {**special, **added})  # type: ignore[arg-type]
    id_of = {**{t: i for i, t in bpe.items()}, **special, **added}
    wrapped: Encoding = SplitEncoding(encoding, splits) if splits else encoding
    return _Vocabulary(wrapped, special, added, id_of, num_ids, nfc)


def _pattern(pre: Mapping[str, Any] | None) -> tuple[str, list[str]]:
    """The one regex equal to a supported tokenizer.json pre_tokenizer, or (several isolating Splits in
    turn, as DeepSeek-V3's) the whole-piece pattern and the Splits' regexes; TokenizerError for the rest."""
    steps = list(pre.get("pretokenizers", [])) if pre and pre.get("type") == "Sequence" else [pre] if pre else []
    kinds = [step.get("type") for step in steps]
    byte_level = steps[-1] if kinds and kinds[-1] == "ByteLevel" else None
    if byte_level is None or byte_level.get("add_prefix_space"):
        raise TokenizerError(
            f"pre_tokenizer {kinds} is not supported: it must end in ByteLevel without add_prefix_space"
        )
    uses_regex = byte_level.get("use_regex", True)
    if kinds == ["ByteLevel"] and uses_regex:
        return GPT2_PATTERN, []
    if kinds == ["Digits", "ByteLevel"] and uses_regex:
        pattern = GPT2_INDIVIDUAL_DIGITS_PATTERN if steps[0].get("individual_digits") else GPT2_DIGIT_RUNS_PATTERN
        return pattern, []
    if len(kinds) >= 2 and set(kinds[:-1]) == {"Split"} and not uses_regex:
        regexes = [_isolated_split_regex(split) for split in steps[:-1]]
        if len(regexes) > 1:
            return WHOLE_PIECE_PATTERN, regexes
        # HF keeps the text between matches as pieces; tiktoken drops it, so match that text too.
        return f"{regexes[0]}|(?:(?!(?:{regexes[0]}))[\\s\\S])+", []
    raise TokenizerError(f"pre_tokenizer {kinds} is not supported")


def _isolated_split_regex(split: Mapping[str, Any]) -> str:
    regex = (split.get("pattern") or {}).get("Regex")
    if regex is None or split.get("behavior") != "Isolated" or split.get("invert"):
        raise TokenizerError(f"Split pre-tokenizer {split} is not supported: need an isolated, non-inverted Regex")
    return str(regex)


def _normalizer_is_nfc(normalizer: Mapping[str, Any] | None) -> bool:
    if normalizer is None:
        return False
    if normalizer.get("type") == "NFC":
        return True
    if normalizer.get("type") == "Sequence" and not normalizer.get("normalizers"):
        return False
    raise TokenizerError(f"normalizer {normalizer.get('type')!r} is not supported (only none or NFC)")


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json writes a token as its text or as a serialized AddedToken."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _post_processor_adds(processor: Mapping[str, Any] | None, bos_text: str) -> bool:
    """Whether tokenizer.json's post-processor puts BOS in front of a single sequence (Llama 3 style)."""
    if not processor:
        return False
    if processor.get("type") == "Sequence":
        return any(_post_processor_adds(p, bos_text) for p in processor.get("processors", []))
    if processor.get("type") != "TemplateProcessing":
        return False
    single = processor.get("single") or []
    return bool(single) and (single[0].get("SpecialToken") or {}).get("id") == bos_text


def _chat_template(root: Path, config: Mapping[str, Any]) -> str | None:
    standalone = root / "chat_template.jinja"
    if standalone.is_file():
        return standalone.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: take "default", else the first
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    with path.open(encoding="utf-8") as f:
        loaded = json.load(f)
    return loaded if isinstance(loaded, dict) else None
