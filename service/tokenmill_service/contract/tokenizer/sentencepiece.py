"""SentencePiece vocabularies (Llama 2, Mistral, TinyLlama, Phi-3, T5) as an Encoding on Hugging Face ``tokenizers``.

A GGUF's ``tokenizer.ggml.model == "llama"`` is llama.cpp's SPM: spaces become ``▁`` (one put in front
of the text), then, starting from single characters, the adjacent pair whose joined text is the
best-scored token is merged until no pair is a token; a character without a token becomes the
``<0xXX>`` tokens of its UTF-8 bytes. That is BPE whose merges are every split of a token into two
tokens, ranked by the token's score, with byte fallback: built here as a ``tokenizers`` BPE, the way
transformers' GGUF converter does it. A Hugging Face tokenizer.json of that kind (BPE with byte
fallback, or Unigram) is loaded by ``tokenizers`` as it is.

Decoding never goes through ``tokenizers``: each token's bytes are fixed once (``▁`` as a space,
``<0xXX>`` as its byte), so a character split over byte tokens streams as raw bytes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tokenizers
from tokenizers import AddedToken, decoders, normalizers
from tokenizers.models import BPE

from tokenmill_service.contract.tokenizer.tokenizer import Tokenizer, TokenizerError

if TYPE_CHECKING:
    from tokenmill_service.contract.tokenizer.gguf import GgufField

SPACE = "\u2581"  # "▁", SentencePiece's stand-in for a space

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")

# GGUF token types (llama.cpp's llama_token_type).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6


class SentencePieceEncoding:
    """The Encoding the Tokenizer asks for, over a ``tokenizers.Tokenizer`` of a SentencePiece vocabulary.

    ``pieces[id]`` is each token's bytes (None where the id has no token). ``strip_first_space`` drops
    the space that encoding put in front of the text, from the first token of a decoded sequence only
    (llama.cpp's detokenize, HF's Strip decoder): a token decoded alone keeps it, since a generated
    token continues the prompt.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        pieces: Sequence[bytes | None],
        *,
        strip_first_space: bool,
        space: str = SPACE,
    ) -> None:
        self._backend = backend
        # Control-token text in the input stays text (llama.cpp's parse_special=false); the Tokenizer
        # parses the chat template's control tokens itself.
        self._backend.encode_special_tokens = True
        self._pieces = list(pieces)
        self._strip_first_space = strip_first_space
        self._space = space
        added = backend.get_added_tokens_decoder()
        self.special_tokens = {t.content: i for i, t in sorted(added.items()) if t.special}
        self.added_tokens = {t.content: i for i, t in sorted(added.items()) if not t.special}
        self._special_ids = frozenset(self.special_tokens.values())
        byte_tokens = {i for t, i in backend.get_vocab().items() if _BYTE_TOKEN.fullmatch(t)}
        self._unmatchable = self._special_ids | byte_tokens
        self._byte_ids: dict[int, int] = {}
        for token_id, piece in enumerate(self._pieces):
            if piece is not None and len(piece) == 1 and token_id not in self._special_ids:
                self._byte_ids.setdefault(piece[0], token_id)
        self.num_ids = len(self._pieces)

    @property
    def backend(self) -> tokenizers.Tokenizer:
        return self._backend

    # -- the Encoding protocol ----------------------------------------------------------------

    def encode(self, text: str, *, allowed_special: AbstractSet[str], disallowed_special: Collection[str]) -> list[int]:
        """Text to ids, parsing the added (user-defined) tokens when ``allowed_special`` names them all.

        ``tokenizers`` parses either all of a tokenizer's non-special added tokens or, with a second
        tokenizer that has none, none of them; a subset is refused rather than silently widened.
        """
        for special in disallowed_special:
            if special in text:
                raise ValueError(f"text holds the special token {special!r}")
        allowed = set(allowed_special)
        if not allowed:
            return self.encode_ordinary(text)
        if allowed != set(self.added_tokens):
            raise ValueError("a SentencePiece encoding parses all of its added tokens or none")
        return self._encode(self._backend, text)

    def encode_ordinary(self, text: str) -> list[int]:
        return self._encode(self._ordinary_backend if self.added_tokens else self._backend, text)

    def _encode(self, backend: tokenizers.Tokenizer, text: str) -> list[int]:
        encoded = backend.encode(text, add_special_tokens=False)
        ids = list(encoded.ids)
        if not self._unmatchable.intersection(ids):
            return ids
        # A Unigram model keeps its control and byte pieces in the vocabulary it matches text against,
        # so text that spells out "</s>" or "<0x41>" would become that token; sentencepiece and
        # llama.cpp never match them. Such a piece is spelled out character by character instead.
        out: list[int] = []
        for token, token_id, (start, end) in zip(encoded.tokens, ids, encoded.offsets):
            literal = token_id in self._unmatchable and text[start:end].replace(" ", self._space) == token
            out += self._spelled(text[start:end]) if literal else [token_id]
        return out

    def _spelled(self, text: str) -> list[int]:
        ids: list[int] = []
        for char in text.replace(" ", self._space):
            token_id = self._backend.token_to_id(char)
            if token_id is not None and token_id not in self._special_ids:
                ids.append(token_id)
            else:  # a byte without a token is dropped, as for byte-level BPE
                ids += [self._byte_ids[b] for b in char.encode("utf-8") if b in self._byte_ids]
        return ids

    def decode_bytes(self, tokens: Sequence[int]) -> bytes:
        data = b"".join(map(self.decode_single_token_bytes, tokens))
        if self._strip_first_space and tokens and self.decode_single_token_bytes(tokens[0]).startswith(b" "):
            return data[1:]
        return data

    def decode_single_token_bytes(self, token: int) -> bytes:
        piece = self._pieces[token] if 0 <= token < len(self._pieces) else None
        if piece is None:
            raise KeyError(token)
        return piece

    @cached_property
    def _ordinary_backend(self) -> tokenizers.Tokenizer:
        """The same tokenizer without its non-special added tokens, for text whose added-token text is text."""
        spec = json.loads(self._backend.to_str())
        spec["added_tokens"] = [a for a in spec.get("added_tokens", []) if a.get("special")]
        backend = tokenizers.Tokenizer.from_str(json.dumps(spec))
        backend.encode_special_tokens = True
        return backend


# --- a GGUF's "llama" vocabulary ----------------------------------------------------------------


def sentencepiece_from_gguf(name: str, field: GgufField) -> Tokenizer:
    """``tokenizer.ggml.model == "llama"``: SentencePiece tokens with scores and token types."""
    tokens: list[str] | None = field("tokenizer.ggml.tokens")
    scores: list[float] | None = field("tokenizer.ggml.scores")
    if tokens is None or scores is None or len(scores) != len(tokens):
        raise TokenizerError(f"{name}: GGUF metadata lacks tokenizer.ggml.tokens or a score for each of them")
    types: list[int] = field("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    eos = field("tokenizer.ggml.eos_token_id")
    if eos is None:
        raise TokenizerError(f"{name}: GGUF metadata lacks tokenizer.ggml.eos_token_id")
    bos = field("tokenizer.ggml.bos_token_id")
    unk = field("tokenizer.ggml.unknown_token_id")
    # llama.cpp's defaults for a SentencePiece vocabulary that does not say.
    add_space_prefix = field("tokenizer.ggml.add_space_prefix")
    add_space_prefix = True if add_space_prefix is None else bool(add_space_prefix)
    add_bos = field("tokenizer.ggml.add_bos_token")
    add_bos = True if add_bos is None else bool(add_bos)

    backend = build_sentencepiece_bpe(
        tokens, scores, types, unk_token=None if unk is None else tokens[int(unk)], add_space_prefix=add_space_prefix
    )
    encoding = SentencePieceEncoding(
        backend, [_gguf_piece(t, kind) for t, kind in zip(tokens, types)], strip_first_space=add_space_prefix
    )
    # Unknown, unused and undefined tokens carry no text in output, as control tokens; byte tokens do.
    special = {t: i for i, (t, kind) in enumerate(zip(tokens, types)) if kind not in (_NORMAL, _USER_DEFINED, _BYTE)}
    return Tokenizer(
        encoding,
        vocab_size=len(tokens),
        special_tokens=special,
        added_tokens=encoding.added_tokens,
        eos_token_id=int(eos),
        bos_token_id=None if bos is None else int(bos),
        add_bos=add_bos,
        chat_template=field("tokenizer.chat_template"),
    )


def build_sentencepiece_bpe(
    tokens: Sequence[str],
    scores: Sequence[float],
    types: Sequence[int],
    *,
    unk_token: str | None,
    add_space_prefix: bool,
) -> tokenizers.Tokenizer:
    """llama.cpp's SPM tokenizer as a ``tokenizers`` BPE: ids are the token's position, merges follow the scores."""
    vocab: dict[str, int] = {}
    for token_id, text in enumerate(tokens):
        if text:
            vocab[text] = token_id  # a text listed twice is its last id, as in llama.cpp's token_to_id
    # SentencePiece only merges into normal and user-defined pieces: plain text never becomes a
    # control token, and byte tokens only come from byte fallback.
    mergeable = {text for text, kind in zip(tokens, types) if kind in (_NORMAL, _USER_DEFINED)}
    merges = _merges_by_score(vocab, {t: s for t, s in zip(tokens, scores) if t in mergeable}, mergeable)
    model = BPE(vocab=vocab, merges=merges, unk_token=unk_token, byte_fallback=True, fuse_unk=True)
    backend = tokenizers.Tokenizer(model)
    # A normalizer, not Metaspace: llama.cpp prefixes " " to text that already starts with a space
    # ("  hi" -> "▁▁▁hi"), where Metaspace would not; no pre-tokenizer, as merges may cross spaces.
    replace = normalizers.Replace(" ", SPACE)
    backend.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), replace]) if add_space_prefix else replace
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)] if add_space_prefix else steps)
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, kind in zip(tokens, types) if kind == _CONTROL]
    )
    # User-defined tokens are matched whole in the raw text, before the pieces around them are encoded.
    backend.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, kind in zip(tokens, types) if kind == _USER_DEFINED]
    )
    return backend


def _merges_by_score(
    vocab: Mapping[str, int], scores: Mapping[str, float], parts: Collection[str]
) -> list[tuple[str, str]]:
    """Every split of each scored token into two ``parts``, best score first (transformers' generate_merges order:
    then the longer left part, then the ids of the parts)."""
    found: list[tuple[float, int, int, str, str]] = []
    for text, score in scores.items():
        splits = [(text[:cut], text[cut:]) for cut in range(1, len(text))]
        splits = [(left, right) for left, right in splits if left in parts and right in parts]
        splits.sort(key=lambda s: (vocab[s[0]], vocab[s[1]]))
        found += [(score, len(left), len(right), left, right) for left, right in splits]
    found.sort(key=lambda m: (-m[0], -m[1], -m[2]))  # stable: ties keep the vocabulary's order
    return [(left, right) for _, _, _, left, right in found]


def _gguf_piece(text: str, kind: int) -> bytes:
    """A GGUF token's bytes as llama.cpp's token_to_piece gives them (control tokens: their text)."""
    if kind == _BYTE:
        match = _BYTE_TOKEN.fullmatch(text)
        if match:
            return bytes([int(match.group(1), 16)])
    if kind in (_NORMAL, _UNUSED):
        return text.replace(SPACE, " ").encode("utf-8")
    return text.encode("utf-8")


# --- a Hugging Face tokenizer.json --------------------------------------------------------------


def sentencepiece_from_tokenizer_json(path: str | Path, spec: Mapping[str, Any]) -> SentencePieceEncoding:
    """A tokenizer.json whose tokens are SentencePiece pieces (BPE with byte fallback, Unigram); ``spec`` is its
    parsed text, read for the decoder, which says how a piece becomes bytes."""
    space, byte_fallback, strip_first_space = _decoder_rules(spec.get("decoder"))
    backend = tokenizers.Tokenizer.from_file(str(path))
    vocab = backend.get_vocab(with_added_tokens=True)
    added = backend.get_added_tokens_decoder()
    pieces: list[bytes | None] = [None] * (max(vocab.values(), default=-1) + 1)
    for text, token_id in vocab.items():
        if token_id in added:
            pieces[token_id] = text.encode("utf-8")
            continue
        match = _BYTE_TOKEN.fullmatch(text) if byte_fallback else None
        pieces[token_id] = bytes([int(match.group(1), 16)]) if match else text.replace(space, " ").encode("utf-8")
    return SentencePieceEncoding(backend, pieces, strip_first_space=strip_first_space, space=space)


def _decoder_rules(decoder: Mapping[str, Any] | None) -> tuple[str, bool, bool]:
    """(the character decoded as a space, whether ``<0xXX>`` is a byte, whether the first space is dropped) from a
    SentencePiece-style decoder; TokenizerError for any other."""
    steps: Iterable[Mapping[str, Any]] = (
        decoder.get("decoders", []) if decoder and decoder.get("type") == "Sequence" else [decoder] if decoder else []
    )
    space: str | None = None
    byte_fallback = strip_first_space = False
    for step in steps:
        kind = step.get("type")
        if kind == "Replace" and step.get("content") == " " and "String" in (step.get("pattern") or {}):
            space = step["pattern"]["String"]
        elif kind == "Metaspace":
            space = step.get("replacement", SPACE)
            scheme = step.get("prepend_scheme", "always" if step.get("add_prefix_space", True) else "never")
            strip_first_space = scheme != "never"
        elif kind == "ByteFallback":
            byte_fallback = True
        elif kind == "Strip" and step.get("content") == " " and step.get("start", 0) <= 1 and not step.get("stop"):
            strip_first_space = step.get("start") == 1
        elif kind != "Fuse":
            raise TokenizerError(f"decoder step {kind!r} is not supported for a SentencePiece tokenizer.json")
    if space is None:
        raise TokenizerError("a SentencePiece decoder that does not turn \u2581 into a space is not supported")
    return space, byte_fallback, strip_first_space
