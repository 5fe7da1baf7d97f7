"""Rank 0 tells the other ranks of its replica what to run, one message per step.

Rank 0 owns the scheduler; the other ranks hold only their shard of the model and its KV cache.
Before each forward pass rank 0 broadcasts the step's ``StepPlan`` (plain lists: token ids,
query lens, starts, block tables, logit rows); every rank then runs the same forward pass, so
the all-reduces and gathers inside the model pair up. With ``--speculative-method mtp`` each step is
followed by the draft passes of the model's multi-token-prediction layer, each a ``DraftPass`` sent and
run the same way (worker/engine/mtp_drafter.py). While idle, rank 0 sends ``Idle`` now and
then: every collective has a timeout (``init_process_group(timeout=...)``), and a rank that
hears nothing for that long takes its peer for dead and exits rather than waiting forever.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog
import torch.distributed as dist

from tokenmill_service.worker.distributed.parallel import TensorParallel
from tokenmill_service.worker.engine.model_runner import ModelRunner, StepPlan
from tokenmill_service.worker.engine.mtp_drafter import DraftPass, DraftPassRunner

if TYPE_CHECKING:
    from tokenmill_service.worker.engine.llm_engine import LLMEngine

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class Idle:
    """Nothing to run; proof that rank 0 is alive."""


@dataclass(frozen=True, slots=True)
class Stop:
    """The replica shuts down: leave the loop and the group."""


StepMessage = StepPlan | DraftPass | Idle | Stop


def broadcast_from_rank0(value: object, tp: TensorParallel) -> object:
    """Rank 0's ``value`` on every rank (pickled; the plans are small lists)."""
    box = [value if tp.rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class StepBroadcast:
    """Rank 0's side: hands each plan and draft pass (and idle ticks, and the stop) to the other ranks."""

    def __init__(self, tp: TensorParallel) -> None:
        assert tp.rank == 0
        self.tp = tp

    def send(self, message: StepMessage) -> None:
        broadcast_from_rank0(message, self.tp)


def lead(engine: LLMEngine, tp: TensorParallel) -> StepBroadcast:
    """Rank 0: have ``engine`` send each step's plan, and each pass of its MTP drafter, to the other ranks
    before running it; the broadcast, for the idle ticks and the stop."""
    broadcast = StepBroadcast(tp)
    engine.runner.broadcast = broadcast
    if engine.drafter is not None:
        engine.drafter.broadcast = broadcast
    return broadcast


def follow(runner: ModelRunner, tp: TensorParallel, mtp: bool = False) -> None:
    """A rank above 0: run every step rank 0 broadcasts, until it says stop; ``mtp`` (rank 0 drafts with
    the model's multi-token-prediction layer): every draft pass too."""
    drafts = DraftPassRunner(runner.model, runner) if mtp else None
    steps = passes = 0
    while True:
        message = broadcast_from_rank0(None, tp)
        match message:
            case StepPlan():
                runner.execute(message)
                steps += 1
            case DraftPass():
                if drafts is None:
                    raise TypeError(f"rank {tp.rank} got a draft pass but serves no multi-token-prediction layer")
                drafts.execute(message)
                passes += 1
            case Idle():
                pass
            case Stop():
                log.info("follower_stopped", steps=steps, draft_passes=passes)
                return
            case _:
                raise TypeError(f"rank {tp.rank} got an unexpected step message: {message!r}")
