"""What runs this step: which sequences, and how many of their tokens.

Every step the running sequences go first (one decode token each, or the next chunk of a
prompt still being prefilled), then waiting requests are admitted while the batch has room
in sequences (`max_batch_size`), tokens (`max_batch_tokens`; `max_batch_tokens_decoding` where a running
sequence is decoding) and KV blocks. When the pool runs
dry for a running sequence, the newest running sequence is preempted: its blocks are freed
and it goes back to the front of the queue, to be recomputed later. Nobody fails for it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from tokenmill_service.contract.engine_config import EngineConfig
from tokenmill_service.worker.engine.adapters import AdapterManager
from tokenmill_service.worker.engine.block_manager import BlockManager
from tokenmill_service.worker.engine.sequence import Sequence, SequenceStatus
from tokenmill_service.worker.engine.speculation import propose_drafts


@dataclass(slots=True)
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    # New tokens of each sequence in this step, in the same order.
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    def __init__(
        self, config: EngineConfig, block_manager: BlockManager, adapters: AdapterManager | None = None
    ) -> None:
        self.config = config
        self.block_manager = block_manager
        # LoRA adapters: a sequence is admitted only once its adapter holds a slot.
        self.adapters = adapters
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order; the last is the newest

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)
        batch.preempted.append(seq)

    def _drafts(self, seq: Sequence, budget: int, max_model_len: int) -> list[int]:
        """Draft tokens for a decoding sequence (none when speculation is off or cannot fit)."""
        if seq.num_uncomputed_tokens != 1 or len(self.running) > self.config.speculative_max_batch:
            return []
        room = min(self.config.speculative_tokens, budget - 1, max_model_len - seq.num_tokens)
        max_new = seq.request.stopping.max_new_tokens
        if max_new:
            room = min(room, max_new - seq.num_completion_tokens - 1)
        if self.config.speculative_method == "mtp":
            drafts = seq.mtp_drafts[: max(room, 0)]  # guessed after the last step (worker/engine/mtp_drafter.py)
        else:
            drafts = propose_drafts(seq.token_ids, room)
        if drafts and seq.matcher is not None:
            # Guesses the grammar refuses would be refused after the forward pass anyway.
            drafts = drafts[: seq.matcher.validate_tokens(drafts)]
        return drafts

    def schedule(self, max_model_len: int = 1 << 62) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_batch_tokens
        if any(seq.num_uncomputed_tokens == 1 for seq in self.running):
            # A stream is decoding: a shorter step, so that a burst of new prompts pauses it for less.
            budget = min(budget, max(self.config.max_batch_tokens_decoding, self.config.max_batch_size))

        # 1. Running sequences, oldest first; make room by preempting the newest.
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens, budget)
            if n <= 0:
                i += 1
                continue
            seq.drafts = self._drafts(seq, budget, max_model_len)
            if seq.drafts:
                # Guesses only take blocks that leave one for every running sequence's next token.
                upto = seq.num_computed_tokens + n + len(seq.drafts)
                spare = self.block_manager.num_free_blocks - len(self.running) * self.block_manager.num_groups
                if self.block_manager.blocks_needed(seq, upto) > spare or not self.block_manager.allocate(seq, upto):
                    seq.drafts = []
            n += len(seq.drafts)
            while not self.block_manager.allocate(seq, seq.num_computed_tokens + n):
                victim = self.running[-1]
                self._preempt(victim, batch)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break  # it preempted itself: everything after it is gone too
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
            i += 1

        # 2. Waiting requests, in arrival order, while there is room; never after a preemption,
        #    which means the pool is already too full for what is running. A choice of a request
        #    with several (n > 1) waits while a sibling computes their shared prompt, then takes its
        #    blocks from the prefix cache instead of computing them again.
        held = {s.request.prefix_group for s in self.running if self._fills_shared_prompt(s)}
        i = 0
        while i < len(self.waiting) and not batch.preempted and budget > 0:
            if len(self.running) >= self.config.max_batch_size:
                break
            seq = self.waiting[i]
            if seq.request.prefix_group in held:
                i += 1
                continue
            adapter, adapters = seq.request.adapter, self.adapters
            if (
                adapter
                and adapters is not None
                and not adapters.acquire(adapter, {s.request.adapter for s in self.running})
            ):
                break  # every slot holds an adapter of a running sequence
            self.block_manager.reuse_cached_prefix(seq)
            n = min(seq.num_uncomputed_tokens, budget)
            if not self.block_manager.allocate(seq, seq.num_computed_tokens + n):
                self.block_manager.free(seq)
                seq.num_computed_tokens = 0
                break
            del self.waiting[i]
            if self._fills_shared_prompt(seq):
                held.add(seq.request.prefix_group)
            seq.drafts = []
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
        return batch

    def _fills_shared_prompt(self, seq: Sequence) -> bool:
        """Whether `seq` is computing prompt blocks its siblings (same prefix_group) can share."""
        shareable = (seq.num_prompt_tokens - 1) // self.block_manager.block_size * self.block_manager.block_size
        return (
            bool(seq.request.prefix_group)
            and self.block_manager.enable_prefix_caching
            and seq.num_computed_tokens < shareable
        )

    def finish(self, seq: Sequence) -> None:
        """Drop a finished or cancelled sequence and return its blocks at once."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
