"""Turn one sequence's generated tokens into a text stream, token by token, honouring stop strings.

Two things make the text of the next token unsafe to emit at once: a UTF-8 character whose bytes
are split across tokens (held until whole; invalid bytes become U+FFFD as soon as they are known to
be invalid), and text that might be the beginning of a stop string (held until it either completes
the stop string, and is dropped with everything after it, or can no longer do so).
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import Protocol


class TokenSource(Protocol):
    """What the detokenizer needs from a tokenizer."""

    def token_bytes(self, token_id: int) -> bytes: ...

    def is_special(self, token_id: int) -> bool: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: TokenSource, stop: Sequence[str] = ()) -> None:
        self._tokenizer = tokenizer
        # An empty stop string would match before any text; it means "no stop string".
        self._stops = tuple(dict.fromkeys(s for s in stop if s))
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._held = ""  # decoded, not yet emitted: a possible start of a stop string
        self._emitted: list[str] = []
        self.stopped = False
        self.matched_stop: str | None = None

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self._emitted)

    def add(self, token_id: int) -> str:
        """Take one generated token; return the text that became safe to emit (often empty)."""
        if self.stopped or self._tokenizer.is_special(token_id):
            return ""
        return self._push(self._utf8.decode(self._tokenizer.token_bytes(token_id)), final=False)

    def prime(self, token_ids: Sequence[int]) -> None:
        """Take tokens whose text was already emitted elsewhere (a resumed stream): afterwards this
        detokenizer holds exactly what one that had taken them one by one would hold."""
        for token_id in token_ids:
            self.add(token_id)

    def flush(self) -> str:
        """At the end of generation: emit what was held back (a stop string that never completed is text)."""
        if self.stopped:
            return ""
        return self._push(self._utf8.decode(b"", final=True), final=True)

    def _push(self, new_text: str, *, final: bool) -> str:
        text = self._held + new_text
        # A stop string cannot start in text already emitted: such a start would have been held.
        cut = self._first_stop(text)
        if cut is not None:
            self.stopped = True
            self._held = ""
            return self._emit(text[:cut])
        keep = 0 if final else self._stop_prefix_length(text)
        self._held = text[len(text) - keep :] if keep else ""
        return self._emit(text[: len(text) - keep])

    def _first_stop(self, text: str) -> int | None:
        best: int | None = None
        for stop in self._stops:
            at = text.find(stop)
            if at >= 0 and (best is None or at < best):
                best, self.matched_stop = at, stop
        return best

    def _stop_prefix_length(self, text: str) -> int:
        """Length of the longest end of ``text`` that begins some stop string."""
        longest = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest

    def _emit(self, text: str) -> str:
        if text:
            self._emitted.append(text)
        return text
