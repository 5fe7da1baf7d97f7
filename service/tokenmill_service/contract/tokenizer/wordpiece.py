"""WordPiece vocabularies (BERT's: bge-small, all-MiniLM) as an Encoding on Hugging Face ``tokenizers``.

A Hugging Face tokenizer.json of that kind is loaded by ``tokenizers`` as it is (normalizer, pre-tokenizer,
model). A GGUF's ``tokenizer.ggml.model == "bert"`` is llama.cpp's WPM vocabulary, whose converter wrote each
word-initial token with a ``▁`` in front and each continuation without its ``##``: the WordPiece vocabulary
is rebuilt from that, lowercased and split at punctuation as llama.cpp does. The special tokens a text gets
([CLS] ... [SEP]) are worker/models/embedding_spec.py's business; encoding here adds none.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tokenizers
from tokenizers import normalizers, pre_tokenizers
from tokenizers.models import WordPiece

from tokenmill_service.contract.tokenizer.tokenizer import Tokenizer, TokenizerError

if TYPE_CHECKING:
    from tokenmill_service.contract.tokenizer.gguf import GgufField

_PHANTOM_SPACE = "\u2581"  # llama.cpp's mark of a word-initial token
_CONTINUATION = "##"
_CONTROL = 3  # llama.cpp's token type of [CLS], [SEP], [PAD], [MASK]
_UNKNOWN = 2


class WordPieceEncoding:
    """The Encoding the Tokenizer asks for, over a ``tokenizers.Tokenizer`` with a WordPiece model."""

    def __init__(self, backend: tokenizers.Tokenizer) -> None:
        self._backend = backend
        # Special-token text in the input stays text, as for every other encoding here.
        self._backend.encode_special_tokens = True
        self._backend.no_truncation()
        self._backend.no_padding()
        added = backend.get_added_tokens_decoder()
        self.special_tokens = {t.content: i for i, t in sorted(added.items()) if t.special}
        self.num_ids = backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, allowed_special: AbstractSet[str], disallowed_special: Collection[str]) -> list[int]:
        for special in disallowed_special:
            if special in text:
                raise ValueError(f"text holds the special token {special!r}")
        return self.encode_ordinary(text)

    def encode_ordinary(self, text: str) -> list[int]:
        return list(self._backend.encode(text, add_special_tokens=False).ids)

    def decode_bytes(self, tokens: Sequence[int]) -> bytes:
        if any(self._backend.id_to_token(t) is None for t in tokens):
            raise KeyError(tokens)
        text: str = self._backend.decode(list(tokens), skip_special_tokens=False)
        return text.encode("utf-8")

    def decode_single_token_bytes(self, token: int) -> bytes:
        piece = self._backend.id_to_token(token)
        if piece is None:
            raise KeyError(token)
        return piece.removeprefix(_CONTINUATION).encode("utf-8")


def wordpiece_from_tokenizer_json(path: Path, config: Mapping[str, Any]) -> Tokenizer:
    """A tokenizer.json whose model is WordPiece, with its tokenizer_config.json (``config``)."""
    return _tokenizer(tokenizers.Tokenizer.from_file(str(path)), config.get("sep_token"), config.get("cls_token"))


def wordpiece_from_gguf(name: str, field: GgufField) -> Tokenizer:
    """``tokenizer.ggml.model == "bert"``: llama.cpp's WPM vocabulary as the WordPiece one it was converted from."""
    tokens: list[str] | None = field("tokenizer.ggml.tokens")
    if tokens is None:
        raise TokenizerError("GGUF metadata lacks tokenizer.ggml.tokens")
    types: list[int] = field("tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab: dict[str, int] = {}
    special: list[str] = []
    unk = "[UNK]"
    for i, (token, kind) in enumerate(zip(tokens, types)):
        if kind in (_CONTROL, _UNKNOWN):
            special.append(token)
            piece = token
            if kind == _UNKNOWN:
                unk = token
        elif token.startswith(_PHANTOM_SPACE):
            piece = token[len(_PHANTOM_SPACE) :]
        else:
            piece = _CONTINUATION + token
        vocab.setdefault(piece, i)
    backend = tokenizers.Tokenizer(WordPiece(vocab, unk_token=unk, continuing_subword_prefix=_CONTINUATION))
    backend.normalizer = normalizers.BertNormalizer(lowercase=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.add_special_tokens([t for t in special if t in vocab])
    sep, cls = field("tokenizer.ggml.seperator_token_id"), field("tokenizer.ggml.bos_token_id")
    return _tokenizer(
        backend, None if sep is None else tokens[int(sep)], None if cls is None else tokens[int(cls)], name
    )


def _tokenizer(backend: tokenizers.Tokenizer, sep: Any, cls: Any, name: str = "") -> Tokenizer:
    encoding = WordPieceEncoding(backend)
    sep_text = sep.get("content") if isinstance(sep, Mapping) else sep
    cls_text = cls.get("content") if isinstance(cls, Mapping) else cls
    sep_id = None if sep_text is None else backend.token_to_id(str(sep_text))
    if sep_id is None:
        raise TokenizerError(f"the WordPiece tokenizer {name} names no [SEP] token in its vocabulary ({sep_text!r})")
    cls_id = None if cls_text is None else backend.token_to_id(str(cls_text))
    # An encoder never generates: its [SEP] stands where the end of a text is asked for, nothing is sampled.
    return Tokenizer(
        encoding,
        vocab_size=encoding.num_ids,
        special_tokens=encoding.special_tokens,
        added_tokens={},
        eos_token_id=sep_id,
        bos_token_id=cls_id,
        add_bos=False,
        chat_template=None,
    )
