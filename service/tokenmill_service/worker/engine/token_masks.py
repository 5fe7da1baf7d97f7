"""The allowed-token masks of a step's constrained sequences, filled by a thread while the forward pass runs.

The engine hands over, before it runs the model, each constrained sequence's matcher (contract/grammar.py),
the first of its sampled rows and its drafts; a thread fills one bitmask row per sampled row (llguidance
releases the GIL while it computes, and so does torch while the forward pass runs), and sampling waits
on the result only if it is not ready yet. Row ``first + j`` is the mask after the sequence's own tokens
and its first ``j`` drafts; rows after a draft the grammar refuses allow everything and are never kept
(the token sampled at the refused draft's row differs from it, which ends the accepted chunk).

A mask is a pure function of the sequence's tokens, so a sequence's results do not depend on its batch.
The matchers belong to the thread between ``submit`` and the future's result: the engine touches them
only after that.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance as llg
import structlog
import torch

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class MaskJob:
    first_row: int  # the sequence's first sampled row (its last token's); its drafts' rows follow
    matcher: llg.LLMatcher
    drafts: list[int]
    fallback: list[int]  # what a row allows when the grammar allows nothing (the stop tokens)


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class MaskFiller:
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-masks")

    def submit(self, jobs: list[MaskJob], num_rows: int) -> Future[torch.Tensor]:
        """A future int32 bitmask [num_rows, words] (bit t of a row: token t allowed); rows no job covers
        allow every token."""
        return self._pool.submit(self._fill, jobs, num_rows)

    def _fill(self, jobs: list[MaskJob], num_rows: int) -> torch.Tensor:
        words = bitmask_words(self.vocab_size)
        bitmask = torch.full((num_rows, words), -1, dtype=torch.int32)
        row_bytes = words * 4
        base = bitmask.data_ptr()
        for job in jobs:
            m = job.matcher
            # A drafted stop token ends the sequence where it is kept, so no row after it is used; and a
            # matcher rolled back over a stop token it consumed refuses what it allowed before (llguidance).
            drafts = job.drafts[: next((k for k, t in enumerate(job.drafts) if t in job.fallback), len(job.drafts))]
            valid = m.validate_tokens(drafts) if drafts else 0
            for j in range(valid + 1):
                if j > 0:
                    m.consume_token(drafts[j - 1])
                row = job.first_row + j
                m.unsafe_compute_mask_ptr(base + row * row_bytes, row_bytes)
                if m.is_error() or not bitmask[row].any():
                    # A matcher in an error state allows nothing: end the sequence instead of sampling noise.
                    log.warning("grammar_error", error=m.get_error().split("\n")[0])
                    bitmask[row] = 0
                    for t in job.fallback:
                        bitmask[row, t // 32] |= _bit(t % 32)
            if valid:
                m.rollback(valid)
        return bitmask


def _bit(i: int) -> int:
    """Bit i of an int32 word, as the signed value torch stores."""
    return -(1 << 31) if i == 31 else 1 << i


def allowed_tokens(bitmask: torch.Tensor, vocab: int, device: torch.device) -> torch.Tensor:
    """Bool [rows, vocab] from a bitmask [rows, words]; columns past the bitmask's tokens are refused."""
    shifts = torch.arange(32, dtype=torch.int32)
    bits = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)
    if bits.shape[1] >= vocab:
        bits = bits[:, :vocab]
    else:
        bits = torch.cat([bits, torch.zeros(bits.shape[0], vocab - bits.shape[1], dtype=torch.bool)], dim=1)
    return bits.to(device)
