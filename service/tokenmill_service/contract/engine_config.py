"""The engine's knobs, in one typed place, with defaults that mean something."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class EngineConfig:
    # At most this many sequences run in one forward pass.
    max_batch_size: int = 64
    # At most this many tokens (prefill chunks + one per decode) go through one forward pass;
    # long prompts are prefilled in chunks of what is left, so running decodes keep flowing.
    max_batch_tokens: int = 512
    # ...and at most this many (but one for each sequence of a full batch) where the step carries a decoding
    # sequence: a burst of new prompts is then prefilled in smaller chunks, so the running streams pause less.
    max_batch_tokens_decoding: int = 256
    # Tokens per KV cache block.
    block_size: int = 16
    # Memory for the KV cache pool in bytes (0: let the runner pick from the free memory).
    kv_cache_memory: int = 0
    # Or an exact number of blocks (overrides kv_cache_memory; tests use it to force preemption).
    num_kv_blocks: int = 0
    # Context length served; 0 means the model's own.
    max_model_len: int = 0
    # Share the KV blocks of identical prompt prefixes (every chat starts with the same system prompt).
    enable_prefix_caching: bool = True
    # Record what enters and leaves the prefix cache (worker/engine/kv_events.py), for --kv-events-endpoint.
    kv_events: bool = False
    # Draft tokens guessed from the sequence's own history and checked in the same step
    # (worker/engine/speculation.py): the same tokens and logprobs, more of them per read of the weights.
    speculative_tokens: int = 6
    # ...only while at most this many sequences run: beyond it a step is bound by arithmetic, not
    # by reading the weights, and rejected drafts would cost more than accepted ones save.
    speculative_max_batch: int = 4
    # Where drafts come from: "ngram" (the sequence's history, worker/engine/speculation.py) or "mtp" (the
    # model's multi-token-prediction layers, worker/engine/mtp_drafter.py; the model must have them loaded).
    speculative_method: str = "ngram"

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError("max_batch_size must be at least 1")
        if self.max_batch_tokens < self.max_batch_size:
            raise ValueError(
                f"max_batch_tokens ({self.max_batch_tokens}) must be at least max_batch_size "
                f"({self.max_batch_size}): every running sequence decodes one token per step"
            )
        if self.block_size < 1:
            raise ValueError("block_size must be at least 1")
        if self.speculative_tokens < 0 or self.speculative_max_batch < 0:
            raise ValueError("speculative_tokens and speculative_max_batch must not be negative")
        if self.speculative_method not in ("ngram", "mtp"):
            raise ValueError(f"speculative_method must be ngram or mtp, not {self.speculative_method!r}")
