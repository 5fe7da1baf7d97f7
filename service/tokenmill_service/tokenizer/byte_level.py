"""Byte-level BPE as a tiktoken Encoding: the pre-tokenizer patterns, the byte alphabet, the rank table.

The vocabularies we serve (SmolLM2, Llama 3, Qwen2, GPT-2) are byte-level BPE whose merge order
equals their id order, so the vocabulary itself is a tiktoken rank table (rank = id) and the
merges only serve to check that. Control tokens become tiktoken special tokens.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import tiktoken

from tokenmill_service.tokenizer.tokenizer import TokenizerError

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
