"""Byte-level BPE as a tiktoken Encoding: the pre-tokenizer patterns, the byte alphabet, the rank table.

The vocabularies we serve (SmolLM2, Llama 3, Qwen2, GPT-2) are byte-level BPE whose merge order
equals their id order, so the vocabulary itself is a tiktoken rank table (rank = id) and the
merges only serve to check that. Control tokens become tiktoken special tokens.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet

import regex
import tiktoken

from tokenmill_service.contract.tokenizer.tokenizer import TokenizerError

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
# Qwen3.5's: Qwen2's with combining marks (\p{M}) kept in words.
QWEN35_PATTERN = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""

# Pre-tokenizers that are several regexes applied one after another (llama.cpp's lists, llama-vocab.cpp,
# copied as the C++ string literals they are there: the same escapes mean the same in Python; non-ASCII
# characters escaped, since an editor's normalization would change ranges such as \u1f5f-\u1f7d).
DEEPSEEK_LLM_SPLITS = (
    "[\r\n]",
    (
        "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373"
        "\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f"
        "\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77"
        "\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d"
        "\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4"
        "\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
        "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d"
        "\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a"
        "\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2"
        "\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+"
    ),
    "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
    "\\s+$",
    "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
    "\\p{N}+",
)
DEEPSEEK_CODER_SPLITS = ("[\r\n]", "\\s?\\p{L}+", "\\s?\\p{P}+", "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+", "\\p{N}")
DEEPSEEK_V3_SPLITS = (
    "\\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    (
        "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
        "| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"
    ),
)
FALCON_SPLITS = (
    "[\\p{P}\\$\\+<=>\\^~\\|`]+",
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)",
    "[0-9][0-9][0-9]",
)
# What a SplitEncoding's inner encoding splits: nothing (each piece is one BPE word).
WHOLE_PIECE_PATTERN = r"[\s\S]+"

# --- the encoding -------------------------------------------------------------------------------


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


def split_pieces(text: str, splits: Sequence[regex.Pattern[str]]) -> list[str]:
    """``text`` split by each pattern in turn, as llama.cpp's regex lists split it: a pattern's matches in
    a piece, and the text between them, become pieces; lookarounds and ``$`` see only the piece."""
    pieces = [text] if text else []
    for pattern in splits:
        split: list[str] = []
        for piece in pieces:
            at = 0
            for match in pattern.finditer(piece):
                if match.end() == match.start():
                    continue
                if match.start() > at:
                    split.append(piece[at : match.start()])
                split.append(match.group())
                at = match.end()
            if at < len(piece):
                split.append(piece[at:])
        pieces = split
    return pieces


class SplitEncoding:
    """Byte-level BPE whose pre-tokenizer is several regexes applied in turn, as llama.cpp runs them: each
    splits every piece the previous ones left (its matches, and the text between them, become pieces;
    lookarounds see only the piece), then each piece is one BPE word of ``encoding`` (built with
    ``WHOLE_PIECE_PATTERN``). Special tokens are found first, as tiktoken does."""

    def __init__(self, encoding: tiktoken.Encoding, splits: Sequence[str]) -> None:
        self._enc = encoding
        self._splits = [regex.compile(p) for p in splits]

    def encode_ordinary(self, text: str) -> list[int]:
        return [i for piece in split_pieces(text, self._splits) for i in self._enc.encode_ordinary(piece)]

    def encode(self, text: str, *, allowed_special: AbstractSet[str], disallowed_special: Collection[str]) -> list[int]:
        for special in disallowed_special:
            if special in text:
                raise ValueError(f"the text holds the special token {special!r}")
        if not allowed_special:
            return self.encode_ordinary(text)
        specials = regex.compile("|".join(regex.escape(t) for t in sorted(allowed_special, key=len, reverse=True)))
        ids: list[int] = []
        at = 0
        for match in specials.finditer(text):
            ids += self.encode_ordinary(text[at : match.start()])
            ids.append(self._enc.encode_single_token(match.group()))
            at = match.end()
        return ids + self.encode_ordinary(text[at:])

    def decode_bytes(self, tokens: Sequence[int]) -> bytes:
        return self._enc.decode_bytes(tokens)

    def decode_single_token_bytes(self, token: int) -> bytes:
        return self._enc.decode_single_token_bytes(token)
