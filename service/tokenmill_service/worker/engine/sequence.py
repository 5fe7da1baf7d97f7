"""One request's life inside the engine: its tokens, its KV blocks, its sampler state."""

from __future__ import annotations

import enum
import secrets
import time
from typing import TYPE_CHECKING

from tokenmill_service.contract.request import FinishReason, GenerationRequest, TokenOutput
from tokenmill_service.contract.tokenizer import Tokenizer
from tokenmill_service.worker.engine.detokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    import torch
    from llguidance import LLMatcher


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, request: GenerationRequest, tokenizer: Tokenizer) -> None:
        self.request = request
        self.request_id = request.request_id
        self.token_ids: list[int] = [*request.prompt_ids, *request.resume_ids]
        self.num_prompt_tokens = len(request.prompt_ids)
        # Tokens whose keys and values are in the cache (prefix-cache hits included).
        self.num_computed_tokens = 0
        # Prompt tokens found in the prefix cache at the last admission.
        self.num_cached_tokens = 0
        # Its block table in each KV-cache group (worker/engine/kv_cache_groups.py; one group but for models
        # that mix windowed and global layers), all of one length; none before its first allocation.
        self.block_tables: list[list[int]] = []
        # The prefix hash of each of its full blocks hashed so far (worker/engine/block_manager.py), and how
        # many of its first blocks the windowed groups' sliding window has left behind (freed; NULL_BLOCK
        # in their tables).
        self.block_hashes: list[int] = []
        self.num_dropped_blocks = 0
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        # Random draws are keyed by (seed, position): the same seed gives the same tokens in any batch.
        self.seed = request.sampling.seed if request.sampling.seed is not None else secrets.randbits(63)
        self.detokenizer = IncrementalDetokenizer(tokenizer, request.stopping.stop)
        # A resumed request's text up to here was sent by another engine: rebuild the same state
        # (held UTF-8 bytes, a held possible start of a stop string) without emitting it again.
        self.detokenizer.prime(request.resume_ids)
        stop_ids = set(request.stopping.stop_token_ids)
        if not request.stopping.ignore_eos:
            stop_ids |= tokenizer.stop_token_ids
        self.stop_token_ids = frozenset(stop_ids)
        self.arrival_time = time.monotonic()
        self.first_scheduled_time: float | None = None
        # Prompt logprobs are gathered chunk by chunk during the first prefill only.
        self.wants_prompt_logprobs = request.prompt_logprobs
        self.prompt_tokens: list[TokenOutput] = []
        self.prompt_logprobs_sent = False
        # Tokens guessed for the positions after the last one, checked this step (speculation.py).
        self.drafts: list[int] = []
        # --speculative-method mtp (worker/engine/mtp_drafter.py): the drafts guessed after the last step, and the
        # main model's hidden state at the last position it computed (None: not known).
        self.mtp_drafts: list[int] = []
        self.drafts_proposed = self.drafts_accepted = 0  # this request's drafts checked, and kept
        self.mtp_hidden: torch.Tensor | None = None
        # A constrained sequence's grammar state, after its generated tokens (the engine sets it).
        self.matcher: LLMatcher | None = None
        # What its KV blocks are keyed by besides tokens: its LoRA adapter as registered ("" : the base).
        self.adapter_key = request.adapter

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def block_table(self) -> list[int]:
        """Its first group's block table (the only one but for models that mix windowed and global layers)."""
        return self.block_tables[0] if self.block_tables else []

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def collecting_prompt_logprobs(self) -> bool:
        return self.wants_prompt_logprobs and not self.prompt_logprobs_sent

    def reset_for_recompute(self) -> None:
        """Preempted: its blocks are gone; it will prefill prompt and generated tokens again."""
        self.num_computed_tokens = 0
        self.block_tables, self.block_hashes, self.num_dropped_blocks = [], [], 0
        self.status = SequenceStatus.WAITING
        self.mtp_drafts, self.mtp_hidden = [], None
