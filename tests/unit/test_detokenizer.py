"""Incremental detokenization on SmolLM2's real tokens: UTF-8 safety, stop strings, special tokens."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from tokenmill_service.contract.tokenizer import Tokenizer
from tokenmill_service.worker.engine.detokenizer import IncrementalDetokenizer

IM_END, ENDOFTEXT = 2, 0


def _stream(
    tok: Tokenizer, ids: Sequence[int], stop: Sequence[str] = ()
) -> tuple[list[str], str, IncrementalDetokenizer]:
    """Feed ids one at a time; the per-token outputs and the flushed tail."""
    detok = IncrementalDetokenizer(tok, stop)
    pieces = [detok.add(i) for i in ids]
    return pieces, detok.flush(), detok


def _byte_token(tok: Tokenizer, byte: int) -> int:
    """The id of the token that is exactly one byte."""
    return next(i for i in range(tok.vocab_size) if tok.token_bytes(i) == bytes([byte]))


@pytest.mark.parametrize(
    "text",
    ["Hello, world!", "日本語のテキスト", "Emoji: 🚀🔥👍🏽 and 👨\u200d👩\u200d👧.", "a\r\n\tb  c   ", "café naïve"],
)
def test_streamed_text_equals_decoding_all_at_once(default_tokenizer: Tokenizer, text: str) -> None:
    pieces, tail, detok = _stream(default_tokenizer, default_tokenizer.encode(text))
    assert "".join(pieces) + tail == text
    assert detok.text == text and not detok.stopped


def test_emoji_split_across_tokens_is_emitted_whole_once_complete(default_tokenizer: Tokenizer) -> None:
    ids = default_tokenizer.encode("🚀")
    assert len(ids) >= 2  # the premise: its four bytes span several tokens
    pieces, tail, _ = _stream(default_tokenizer, ids)
    assert pieces == [""] * (len(ids) - 1) + ["🚀"]
    assert tail == ""


def test_no_emitted_piece_holds_a_partial_character(default_tokenizer: Tokenizer) -> None:
    text = "ünïcödé 日本語 🚀🔥👍🏽 ok"
    pieces, _, _ = _stream(default_tokenizer, default_tokenizer.encode(text))
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text


def test_invalid_bytes_become_replacement_characters_without_stalling(default_tokenizer: Tokenizer) -> None:
    tok = default_tokenizer
    lead, continuation = _byte_token(tok, 0xF0), _byte_token(tok, 0x80)
    a = tok.encode("a")[0]
    detok = IncrementalDetokenizer(tok)
    assert detok.add(continuation) == "\ufffd"  # can never start a character: replaced at once
    assert detok.add(lead) == ""  # may still become a character
    assert detok.add(a) == "\ufffda"  # it did not
    assert detok.add(lead) == ""
    assert detok.flush() == "\ufffd"  # cut off at the end


def test_special_tokens_add_no_text(default_tokenizer: Tokenizer) -> None:
    ids = [*default_tokenizer.encode("Hi"), IM_END, ENDOFTEXT, 1]
    pieces, tail, detok = _stream(default_tokenizer, ids)
    assert pieces[-3:] == ["", "", ""]
    assert "".join(pieces) + tail == detok.text == "Hi"


def test_stop_string_split_across_tokens_is_caught_and_never_emitted(default_tokenizer: Tokenizer) -> None:
    tok = default_tokenizer
    stop = "\n\nUser:"
    ids = tok.encode("The answer is 42.\n\nUser: and more")
    stop_ids = tok.encode(stop)
    assert len(stop_ids) >= 3  # the premise: the stop string spans several tokens
    detok = IncrementalDetokenizer(tok, [stop])
    emitted = ""
    for token_id in ids:
        emitted += detok.add(token_id)
        # At no step does any part of the stop string leak out.
        assert emitted == "The answer is 42."[: len(emitted)]
        if detok.stopped:
            break
    assert detok.stopped and detok.matched_stop == stop
    assert emitted == "The answer is 42."
    assert detok.flush() == ""
    assert detok.add(tok.encode(" later")[0]) == ""  # nothing after a stop


def test_text_that_might_start_a_stop_string_is_held_then_released(default_tokenizer: Tokenizer) -> None:
    tok = default_tokenizer
    detok = IncrementalDetokenizer(tok, ["STOP"])
    out = [detok.add(i) for i in tok.encode("I ST")]
    assert "".join(out) == "I "  # "ST" may be the start of "STOP"
    out = [detok.add(i) for i in tok.encode("OCK")]
    assert "".join(out) == "STOCK"  # it was not
    assert not detok.stopped


def test_held_back_text_that_never_became_a_stop_string_is_flushed(default_tokenizer: Tokenizer) -> None:
    pieces, tail, detok = _stream(default_tokenizer, default_tokenizer.encode("wait for it... STO"), ["STOP"])
    assert "".join(pieces) == "wait for it... "
    assert tail == "STO"
    assert detok.text == "wait for it... STO" and not detok.stopped


def test_stop_inside_one_token_drops_the_rest_of_that_token(default_tokenizer: Tokenizer) -> None:
    tok = default_tokenizer
    hello = tok.encode(" Hello")
    assert len(hello) == 1
    pieces, tail, detok = _stream(tok, [*tok.encode("Say"), *hello, *tok.encode(" there")], ["ell"])
    assert "".join(pieces) + tail == "Say H"
    assert detok.stopped


def test_earliest_of_several_stop_strings_wins(default_tokenizer: Tokenizer) -> None:
    pieces, tail, detok = _stream(default_tokenizer, default_tokenizer.encode("one two three"), ["three", "two t"])
    assert "".join(pieces) + tail == "one "
    assert detok.matched_stop == "two t"


def test_stop_string_made_of_a_split_emoji_is_caught(default_tokenizer: Tokenizer) -> None:
    pieces, tail, detok = _stream(default_tokenizer, default_tokenizer.encode("go 🚀 now"), ["🚀"])
    assert "".join(pieces) + tail == "go "
    assert detok.stopped


def test_special_token_between_stop_string_parts_does_not_break_the_match(default_tokenizer: Tokenizer) -> None:
    tok = default_tokenizer
    ids = [*tok.encode("x EN"), ENDOFTEXT, *tok.encode("D y")]
    pieces, tail, detok = _stream(tok, ids, ["END"])
    assert "".join(pieces) + tail == "x "
    assert detok.stopped


def test_empty_stop_strings_are_ignored(default_tokenizer: Tokenizer) -> None:
    pieces, tail, detok = _stream(default_tokenizer, default_tokenizer.encode("abc"), [""])
    assert "".join(pieces) == "abc" and tail == "" and not detok.stopped


def _expected_stream(tok: Tokenizer, ids: Sequence[int], stops: Sequence[str]) -> tuple[str, bool]:
    """The specification, token by token: stop once the whole characters decoded so far hold a stop
    string, and keep the text before the earliest such occurrence."""
    for k in range(1, len(ids) + 1):
        so_far = tok.decode_bytes(ids[:k]).decode("utf-8", errors="ignore")  # drops a trailing partial character
        starts = [so_far.find(s) for s in stops if s in so_far]
        if starts:
            return so_far[: min(starts)], True
    return tok.decode(ids), False


def test_random_texts_and_stops_stream_exactly_the_text_before_the_first_stop(default_tokenizer: Tokenizer) -> None:
    tok = default_tokenizer
    rng = random.Random(7)
    words = ["the", " cat", " sat", "\n", "\n\n", "User", ":", " 🚀", "日本", " é", "###", " END", "1", "23", "  "]
    for _ in range(400):
        text = "".join(rng.choice(words) for _ in range(rng.randint(1, 25)))
        stops = [text[a : a + rng.randint(1, 6)] for a in rng.sample(range(len(text)), k=min(2, len(text)))]
        stops.append("".join(rng.choice(words) for _ in range(2)))  # often absent
        ids = tok.encode(text)
        expected, stopped = _expected_stream(tok, ids, stops)
        detok = IncrementalDetokenizer(tok, stops)
        emitted = ""
        for token_id in ids:
            emitted += detok.add(token_id)
            assert expected.startswith(emitted), (text, stops)
        emitted += detok.flush()
        assert emitted == expected, (text, stops)
        assert detok.stopped == stopped
