"""Per-step attention metadata: what the layers need to know about the batch, and nothing else.

The model never sees requests. A step runs a flat batch of tokens from several sequences
(prefill chunks and single decode tokens side by side); this object says which tokens belong
to which sequence, where their keys and values go in the paged KV cache, and how long each
sequence's context is once this step's tokens are written.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    # Number of new (query) tokens of each sequence in this step; they are laid out
    # back to back in the flat batch, in this order.
    query_lens: list[int]
    # Total number of tokens each sequence attends to after this step (cached + new).
    context_lens: list[int]
    # Flat cache slot (block * block_size + offset) for each new token, shape [num_tokens].
    # None when the model runs without a KV cache (a single full-prompt pass).
    slot_mapping: torch.Tensor | None = None
    # Block ids of each sequence, padded with 0, shape [num_seqs, max_blocks].
    block_tables: torch.Tensor | None = None
    # context_lens as a tensor on the model's device, for the batched decode path.
    context_lens_tensor: torch.Tensor | None = None

    @property
    def is_decode_only(self) -> bool:
        return all(q == 1 for q in self.query_lens)

    @classmethod
    def no_cache(cls, query_lens: list[int]) -> AttentionMetadata:
        """Each sequence attends causally to its own tokens in this batch only."""
        return cls(query_lens=list(query_lens), context_lens=list(query_lens))
