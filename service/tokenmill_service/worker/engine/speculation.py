"""Draft tokens from the sequence itself (prompt lookup, n-gram speculation): when the last few
tokens occurred before, guess that what followed them then follows them again.

A step then runs the sequence's last token and the drafts as one chunk and samples every
position; a draft is kept while it equals the token sampled at its position, and the first
mismatch is replaced by the sampled token. What comes out is exactly what decoding token by token
gives, bit for bit: a chunk's logits equal decoding's (tokenmill's numerics do not depend on how
positions are batched) and each position's draw is keyed by (seed, position). So speculation
changes the speed, never the tokens or their logprobs. It pays where the weights' reads dominate
a step (a few sequences; each weight read serves several positions) and where text repeats
(quoting the prompt, code, lists, a small model's loops).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

# Longest and shortest suffix looked up, and how far back to look.
MAX_MATCH = 4
MIN_MATCH = 2
WINDOW = 2048


def propose_drafts(token_ids: Seq[int], max_drafts: int) -> list[int]:
    """Up to ``max_drafts`` tokens guessed to follow ``token_ids``: what followed the latest earlier
    occurrence of its longest suffix (``MAX_MATCH`` down to ``MIN_MATCH`` tokens), read on as if
    the text repeats with that period past its end; [] when no suffix occurred before."""
    if max_drafts <= 0:
        return []
    history = list(token_ids[-WINDOW:])
    end = len(history)
    for n in range(min(MAX_MATCH, end - 1), MIN_MATCH - 1, -1):
        suffix = history[end - n :]
        first = suffix[0]
        # The latest start before the suffix itself, scanning backwards.
        for start in range(end - n - 1, -1, -1):
            if history[start] == first and history[start : start + n] == suffix:
                period = end - n - start
                for i in range(max_drafts):
                    history.append(history[end + i - period])
                return history[end:]
    return []
