"""Byte-level BPE tokenizer on tiktoken, loaded from a GGUF file or a Hugging Face tokenizer directory.

The vocabularies we serve (SmolLM2, Llama 3, Qwen2, GPT-2) are byte-level BPE whose merge order
equals their id order, so the vocabulary itself is a tiktoken rank table (rank = id) and the
merges only serve to check that. Control tokens become tiktoken special tokens; plain-text
encoding never produces them, whatever the text says. Chat prompts are the one place control
tokens are parsed, and only where the chat template, not a message, wrote them.
"""

from __future__ import annotations

import json
import re
import time
import unicodedata
from collections.abc import Iterable, Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import structlog
import tiktoken

from tokenmill_service.chat_template import ChatTemplate
from tokenmill_service.models.gguf_reader import open_gguf

log = structlog.get_logger(__name__)

# --- pre-tokenizer patterns ---------------------------------------------------------------------

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

# GPT-2's regex applied to the pieces that HF's Digits pre-tokenizer (llama.cpp's "\p{N}" split)
# leaves, as one regex: a digit never takes a leading space (the space ends the piece before it),
# and a whitespace run right before a digit sits at the end of its piece, so it is kept whole
# where GPT-2's `\s+(?!\S)` would give its last character to the next word.
GPT2_INDIVIDUAL_DIGITS_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?![^\s\p{N}])|\s+"""
GPT2_DIGIT_RUNS_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?![^\s\p{N}])|\s+"""

LLAMA3_PATTERN = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
QWEN2_PATTERN = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""

# llama.cpp's `tokenizer.ggml.pre` names whose pre-tokenizer is one of the patterns above.
GGUF_PRE_PATTERNS: dict[str, str] = {
    **dict.fromkeys(("gpt-2", "mpt", "olmo"), GPT2_PATTERN),
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone"), GPT2_INDIVIDUAL_DIGITS_PATTERN
    ),
    "llama3": LLAMA3_PATTERN,
    "llama-v3": LLAMA3_PATTERN,
    "llama-bpe": LLAMA3_PATTERN,
    "qwen2": QWEN2_PATTERN,
}

# Tokens that end a turn or a document: generation stops on them as it does on EOS.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|endoftext|>", "<|end|>", "<end_of_turn>")

# GGUF token types (llama.cpp's llama_token_type).
_GGUF_NORMAL, _GGUF_USER_DEFINED = 1, 4

# Put inside a special-token string found in message content so it no longer matches; a
# noncharacter, and doubled where content already holds it, so the mark is always reversible.
_MARK = "\ufdd0"
_UNMARK = re.compile(f"{_MARK}({_MARK})?")


class TokenizerError(ValueError):
    """The tokenizer files describe a tokenizer this service does not support."""


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-to-unicode map, inverted: the printable character that stands for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + shifted)
            shifted += 1
    return {c: b for b, c in chars.items()}


_BYTE_OF_CHAR = _byte_level_alphabet()


def _token_bytes_from_text(text: str) -> bytes:
    try:
        return bytes(_BYTE_OF_CHAR[c] for c in text)
    except KeyError as exc:
        raise TokenizerError(f"token {text!r} is not byte-level BPE text (character {exc.args[0]!r})") from None


def build_bpe_encoding(
    name: str,
    pattern: str,
    bpe_tokens: Mapping[int, str],
    merges: Iterable[tuple[str, str]],
    special_tokens: Mapping[str, int],
) -> tuple[tiktoken.Encoding, int]:
    """A tiktoken Encoding whose ranks are the BPE token ids; also returns the number of ids."""
    ranks: dict[bytes, int] = {}
    for token_id, text in bpe_tokens.items():
        ranks[_token_bytes_from_text(text)] = token_id
    if len(ranks) != len(bpe_tokens):
        raise TokenizerError(f"{name}: two BPE tokens have the same bytes")
    _check_merge_order(name, bpe_tokens, merges)
    num_ids = max([*bpe_tokens, *special_tokens.values()]) + 1
    # tiktoken needs a rank for every single byte. Bytes the vocabulary lacks (invalid UTF-8 lead
    # bytes, a few control characters) get ids past the vocabulary; encode() drops them, which is
    # what llama.cpp does with a byte it has no token for.
    next_id = num_ids
    for b in range(256):
        if bytes([b]) not in ranks:
            ranks[bytes([b])] = next_id
            next_id += 1
    encoding = tiktoken.Encoding(name, pat_str=pattern, mergeable_ranks=ranks, special_tokens=dict(special_tokens))
    return encoding, num_ids


def _check_merge_order(name: str, bpe_tokens: Mapping[int, str], merges: Iterable[tuple[str, str]]) -> None:
    """Rank = id is only exact when each merge's result comes later in the vocabulary than the last one's."""
    id_of = {text: token_id for token_id, text in bpe_tokens.items()}
    seen: set[int] = set()
    last = -1
    for left, right in merges:
        result = id_of.get(left + right)
        if result is None:
            raise TokenizerError(f"{name}: merge {left!r} + {right!r} makes a token that is not in the vocabulary")
        if result in seen:
            continue  # the same token reached by another split: it keeps its first rank
        if result < last:
            raise TokenizerError(f"{name}: merge order differs from id order at {left + right!r}; unsupported")
        seen.add(result)
        last = result


class Tokenizer:
    """Encode, decode and chat-render for one model; the engine and the service only use this class."""

    def __init__(
        self,
        encoding: tiktoken.Encoding,
        *,
        vocab_size: int,
        special_tokens: Mapping[str, int],
        added_tokens: Mapping[str, int],
        eos_token_id: int,
        bos_token_id: int | None,
        add_bos: bool,
        chat_template: str | None,
        nfc: bool = False,
        extra_stop_ids: Iterable[int] = (),
    ) -> None:
        self._enc = encoding
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.bos_token_id = bos_token_id
        self.add_bos = add_bos
        self.chat_template = chat_template
        self._nfc = nfc
        # Control tokens: never parsed from plain text, carry no text in generated output.
        self._special_by_text = dict(special_tokens)
        self._special_ids = frozenset(special_tokens.values())
        # User-defined added tokens (e.g. "<tool_call>"): parsed from text and shown as text.
        self._added_texts = frozenset(added_tokens)
        end_of_turn = [i for t, i in [*special_tokens.items(), *added_tokens.items()] if t in END_OF_TURN_TOKENS]
        self._stop_ids = frozenset({eos_token_id, *extra_stop_ids, *end_of_turn})
        self._bos_text = None if bos_token_id is None else self.token_text(bos_token_id)
        self._eos_text = self.token_text(eos_token_id)
        by_length = sorted(special_tokens, key=len, reverse=True)
        self._special_re = re.compile("|".join(map(re.escape, by_length))) if by_length else None

    # -- construction -----------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """The tokenizer described by a GGUF file's ``tokenizer.*`` metadata."""
        start = time.perf_counter()
        reader = open_gguf(Path(path))

        def field(key: str) -> Any:
            found = reader.get_field(key)
            return None if found is None else found.contents()

        model = field("tokenizer.ggml.model")
        if model != "gpt2":
            raise TokenizerError(f"GGUF tokenizer model {model!r} is not supported; only byte-level BPE ('gpt2')")
        pre = field("tokenizer.ggml.pre") or "default"
        pattern = GGUF_PRE_PATTERNS.get(pre)
        if pattern is None:
            known = ", ".join(sorted(GGUF_PRE_PATTERNS))
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
        special = {
            t: i for i, (t, kind) in enumerate(zip(tokens, types)) if kind not in (_GGUF_NORMAL, _GGUF_USER_DEFINED)
        }
        added = {t: i for i, (t, kind) in enumerate(zip(tokens, types)) if kind == _GGUF_USER_DEFINED}
        pairs = (tuple(m.split(" ", 1)) for m in merges)
        encoding, num_ids = build_bpe_encoding(Path(path).stem, pattern, bpe, pairs, {**special, **added})  # type: ignore[arg-type]
        tokenizer = cls(
            encoding,
            vocab_size=max(num_ids, len(tokens)),
            special_tokens=special,
            added_tokens=added,
            eos_token_id=int(eos),
            bos_token_id=None if bos is None else int(bos),
            add_bos=bool(field("tokenizer.ggml.add_bos_token")),
            chat_template=field("tokenizer.chat_template"),
        )
        log.info("tokenizer_loaded", source=str(path), pre=pre, vocab_size=tokenizer.vocab_size, seconds=_since(start))
        return tokenizer

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """A Hugging Face directory with a byte-level BPE ``tokenizer.json`` (and ``tokenizer_config.json``)."""
        start = time.perf_counter()
        root = Path(path)
        spec = _read_json(root / "tokenizer.json")
        if spec is None:
            raise TokenizerError(f"{root} has no tokenizer.json")
        config = _read_json(root / "tokenizer_config.json") or {}
        model = spec.get("model") or {}
        if model.get("type") != "BPE" or model.get("byte_fallback"):
            raise TokenizerError(
                f"tokenizer model {model.get('type')!r} (byte_fallback={model.get('byte_fallback')}) is not supported; "
                "only byte-level BPE"
            )
        nfc = _hf_normalizer_is_nfc(spec.get("normalizer"))
        pattern = _hf_pattern(spec.get("pre_tokenizer"))

        added_specs = spec.get("added_tokens") or []
        special = {a["content"]: int(a["id"]) for a in added_specs if a.get("special", True)}
        added = {a["content"]: int(a["id"]) for a in added_specs if not a.get("special", True)}
        added_ids = {*special.values(), *added.values()}
        bpe = {int(i): t for t, i in model["vocab"].items() if int(i) not in added_ids}
        pairs = (tuple(m.split(" ", 1)) if isinstance(m, str) else (m[0], m[1]) for m in model.get("merges", []))
        encoding, num_ids = build_bpe_encoding(root.name, pattern, bpe, pairs, {**special, **added})  # type: ignore[arg-type]

        id_of = {**{t: i for i, t in bpe.items()}, **special, **added}
        eos_text = _hf_token_text(config.get("eos_token"))
        if eos_text is None or eos_text not in id_of:
            raise TokenizerError(f"{root}: tokenizer_config.json names no eos_token in the vocabulary ({eos_text!r})")
        bos_text = _hf_token_text(config.get("bos_token"))
        bos_id = id_of.get(bos_text) if bos_text is not None else None
        add_bos = config.get("add_bos_token")
        if add_bos is None:
            add_bos = bos_text is not None and _hf_post_processor_adds(spec.get("post_processor"), bos_text)
        generation = _read_json(root / "generation_config.json") or {}
        extra_eos = generation.get("eos_token_id")
        extra_eos = [] if extra_eos is None else [extra_eos] if isinstance(extra_eos, int) else list(extra_eos)

        tokenizer = cls(
            encoding,
            vocab_size=num_ids,
            special_tokens=special,
            added_tokens=added,
            eos_token_id=id_of[eos_text],
            bos_token_id=bos_id,
            add_bos=bool(add_bos),
            chat_template=_hf_chat_template(root, config),
            nfc=nfc,
            extra_stop_ids=(int(i) for i in extra_eos),
        )
        log.info("tokenizer_loaded", source=str(root), vocab_size=tokenizer.vocab_size, seconds=_since(start))
        return tokenizer

    # -- tokens ------------------------------------------------------------------------------

    @property
    def stop_token_ids(self) -> frozenset[int]:
        return self._stop_ids

    def encode(self, text: str) -> list[int]:
        """Plain text to ids: no BOS, and special-token text stays text."""
        if self._nfc:
            text = unicodedata.normalize("NFC", text)
        if self._added_texts:
            ids = self._enc.encode(text, allowed_special=self._added_texts, disallowed_special=())
        else:
            ids = self._enc.encode_ordinary(text)
        limit = self.vocab_size
        # Ids at or past the vocabulary stand for bytes the model has no token for.
        return ids if not ids or max(ids) < limit else [i for i in ids if i < limit]

    def decode(self, ids: Sequence[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        if ids and min(ids) >= 0 and max(ids) < self.vocab_size:
            try:
                return self._enc.decode_bytes(ids)
            except KeyError:
                pass  # an id with no token (a gap in the vocabulary): fall back to one at a time
        return b"".join(self.token_bytes(i) for i in ids)

    def token_bytes(self, token_id: int) -> bytes:
        """A token's bytes; a special token's are its text's UTF-8, an id with no token has none."""
        if not 0 <= token_id < self.vocab_size:
            return b""
        try:
            return self._enc.decode_single_token_bytes(token_id)
        except KeyError:
            return b""

    def token_text(self, token_id: int) -> str:
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    # -- chat --------------------------------------------------------------------------------

    @cached_property
    def _chat(self) -> ChatTemplate:
        # Compiled on first use, so a broken template only fails chat requests, not loading.
        return ChatTemplate(self.chat_template, bos_token=self._bos_text, eos_token=self._eos_text)

    @property
    def chat_roles(self) -> frozenset[str]:
        """Roles this model's chat template accepts."""
        return self._chat.roles

    def validate_messages(self, messages: Sequence[Mapping[str, str]]) -> None:
        """Raise ``ValueError`` (naming the role) for a message the chat template cannot take."""
        self._chat.validate_messages(messages)

    def render_chat(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> str:
        return self._chat.render(messages, add_generation_prompt)

    def encode_chat(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """The prompt ids: the template's special tokens as special ids, message text always as text."""
        self._chat.validate_messages(messages)
        rendered = self._chat.render([self._mark_message(m) for m in messages], add_generation_prompt)
        ids: list[int] = []
        pos = 0
        if self._special_re is not None:
            for match in self._special_re.finditer(rendered):
                ids += self.encode(_unmark(rendered[pos : match.start()]))
                ids.append(self._special_by_text[match.group()])
                pos = match.end()
        ids += self.encode(_unmark(rendered[pos:]))
        if self.add_bos and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)
        return ids

    def _mark_message(self, message: Mapping[str, str]) -> dict[str, str]:
        return {key: self._mark(value) if isinstance(value, str) else value for key, value in message.items()}

    def _mark(self, text: str) -> str:
        """``text`` with every special-token string broken by a mark that ``_unmark`` removes."""
        text = text.replace(_MARK, _MARK + _MARK)
        if self._special_re is None:
            return text
        # Inside the string, so templates that trim content keep the mark; repeated because one
        # special-token string may hide inside another's remains.
        while self._special_re.search(text):
            text = self._special_re.sub(lambda m: m.group()[0] + _MARK + m.group()[1:], text)
        return text


def _unmark(text: str) -> str:
    return _UNMARK.sub(lambda m: m.group(1) or "", text) if _MARK in text else text


# --- Hugging Face tokenizer.json helpers -------------------------------------------------------


def _hf_pattern(pre: Mapping[str, Any] | None) -> str:
    """The one regex equal to a supported tokenizer.json pre_tokenizer; TokenizerError for the rest."""
    steps = list(pre.get("pretokenizers", [])) if pre and pre.get("type") == "Sequence" else [pre] if pre else []
    kinds = [step.get("type") for step in steps]
    byte_level = steps[-1] if kinds and kinds[-1] == "ByteLevel" else None
    if byte_level is None or byte_level.get("add_prefix_space"):
        raise TokenizerError(
            f"pre_tokenizer {kinds} is not supported: it must end in ByteLevel without add_prefix_space"
        )
    uses_regex = byte_level.get("use_regex", True)
    if kinds == ["ByteLevel"] and uses_regex:
        return GPT2_PATTERN
    if kinds == ["Digits", "ByteLevel"] and uses_regex:
        return GPT2_INDIVIDUAL_DIGITS_PATTERN if steps[0].get("individual_digits") else GPT2_DIGIT_RUNS_PATTERN
    if kinds == ["Split", "ByteLevel"] and not uses_regex:
        split = steps[0]
        regex = (split.get("pattern") or {}).get("Regex")
        if regex is None or split.get("behavior") != "Isolated" or split.get("invert"):
            raise TokenizerError(f"Split pre-tokenizer {split} is not supported: need an isolated, non-inverted Regex")
        # HF keeps the text between matches as pieces; tiktoken drops it, so match that text too.
        return f"{regex}|(?:(?!(?:{regex}))[\\s\\S])+"
    raise TokenizerError(f"pre_tokenizer {kinds} is not supported")


def _hf_normalizer_is_nfc(normalizer: Mapping[str, Any] | None) -> bool:
    if normalizer is None:
        return False
    if normalizer.get("type") == "NFC":
        return True
    if normalizer.get("type") == "Sequence" and not normalizer.get("normalizers"):
        return False
    raise TokenizerError(f"normalizer {normalizer.get('type')!r} is not supported (only none or NFC)")


def _hf_token_text(value: Any) -> str | None:
    """tokenizer_config.json writes a token as its text or as a serialized AddedToken."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _hf_post_processor_adds(processor: Mapping[str, Any] | None, bos_text: str) -> bool:
    """Whether tokenizer.json's post-processor puts BOS in front of a single sequence (Llama 3 style)."""
    if not processor:
        return False
    if processor.get("type") == "Sequence":
        return any(_hf_post_processor_adds(p, bos_text) for p in processor.get("processors", []))
    if processor.get("type") != "TemplateProcessing":
        return False
    single = processor.get("single") or []
    return bool(single) and (single[0].get("SpecialToken") or {}).get("id") == bos_text


def _hf_chat_template(root: Path, config: Mapping[str, Any]) -> str | None:
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


def _since(start: float) -> float:
    return round(time.perf_counter() - start, 3)


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer for a model path: a GGUF file, or a Hugging Face directory with tokenizer.json."""
    path = Path(path)
    if path.is_dir():
        return Tokenizer.from_hf_dir(path)
    if path.is_file():
        with path.open("rb") as f:
            magic = f.read(4)
        if magic == b"GGUF":
            return Tokenizer.from_gguf(path)
        raise TokenizerError(f"{path} is not a GGUF file")
    raise FileNotFoundError(f"no tokenizer at {path}")
