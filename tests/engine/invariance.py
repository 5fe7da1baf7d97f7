"""The batch-invariance check every model family's tests run: a prompt's prefill and its next decode step
give bitwise the same logits alone and between two other sequences (block tables out of order)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tokenmill_service.worker.engine.model_runner import ModelRunner, StepPlan


def assert_alone_equals_crowd(model: Any, prompt: Sequence[int]) -> None:
    """``prompt`` needs at least 35 ids: 13 for the prompt, and the neighbours' around them."""
    a, p, b = list(prompt[20:29]), list(prompt[:13]), list(prompt[30:35])
    next_token = 7

    alone = ModelRunner(model, block_size=4, num_blocks=16)
    table = [9, 3, 12, 5]
    _, (prefill,) = alone.execute(StepPlan(p, [13], [0], [table], [12], [(0, 13)]))
    decode, _ = alone.execute(StepPlan([next_token], [1], [13], [table], [0], []))

    crowd = ModelRunner(model, block_size=4, num_blocks=16)
    tables = [[0, 7, 2], [11, 4, 15, 6], [14, 1]]
    _, (crowd_prefill,) = crowd.execute(StepPlan(a + p + b, [9, 13, 5], [0, 0, 0], tables, [8, 21, 26], [(9, 13)]))
    crowd_decode, _ = crowd.execute(StepPlan([3, next_token, 4], [1, 1, 1], [9, 13, 5], tables, [0, 1, 2], []))
    assert torch.equal(crowd_prefill, prefill)
    assert torch.equal(crowd_decode[1], decode[0])


def assert_prefill_equals_decode(model: Any, prompt: Sequence[int], prefilled: int) -> None:
    """A prompt prefilled whole, and its first ``prefilled`` ids prefilled then the rest decoded one
    token per step: every position's logits bitwise the same (past sliding windows, where a family has them)."""
    n = len(prompt)
    table = list(range(-(-n // 4)))[::-1]  # blocks out of order
    whole = ModelRunner(model, block_size=4, num_blocks=len(table))
    _, (prefill,) = whole.execute(StepPlan(list(prompt), [n], [0], [table], [n - 1], [(0, n)]))
    stepwise = ModelRunner(model, block_size=4, num_blocks=len(table))
    first = list(prompt[:prefilled])
    _, (head,) = stepwise.execute(StepPlan(first, [prefilled], [0], [table], [prefilled - 1], [(0, prefilled)]))
    assert torch.equal(head, prefill[:prefilled])
    for position in range(prefilled, n):
        logits, _ = stepwise.execute(StepPlan([prompt[position]], [1], [position], [table], [0], []))
        assert torch.equal(logits[0], prefill[position]), position
