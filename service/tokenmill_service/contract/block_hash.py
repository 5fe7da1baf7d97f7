"""The prefix hash of a KV-cache block: its tokens chained to the hash of everything before it.

Two sequences that share a prompt prefix get the same hashes for its full blocks, whichever
process computes them: the block manager (to share cached blocks), the router (to send a prompt
where its prefix is cached) and the KV events' subscribers all see the same numbers. Torch-free.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

# The parent of a sequence's first block. A fixed integer rather than None, whose hash varies from
# process to process before Python 3.12; a tuple of integers hashes the same in every process.
ROOT = 0x746F6B656E6D696C


def chain_hash(prev: int | None, token_ids: Sequence[int]) -> int:
    """The hash of one full block of `token_ids` after the block hashed `prev` (None: the first)."""
    return hash((ROOT if prev is None else prev, tuple(token_ids)))


def adapter_root(adapter_key: str) -> int | None:
    """What the first block of a sequence run with a LoRA adapter chains from (None: the base model's
    root), so that keys and values computed under one adapter are never reused for another or for the
    base. From the adapter's registration key by SHA-256: the same in every process."""
    if not adapter_key:
        return None
    return int.from_bytes(hashlib.sha256(adapter_key.encode()).digest()[:8], "little") >> 1


def full_block_hashes(
    token_ids: Sequence[int], block_size: int, limit: int | None = None, adapter_key: str = ""
) -> list[int]:
    """The chained hashes of the full blocks of `token_ids` (at most `limit` of them), in order, as
    computed under the LoRA adapter registered as `adapter_key` ("": the base model)."""
    count = len(token_ids) // block_size
    if limit is not None:
        count = min(count, limit)
    hashes: list[int] = []
    prev = adapter_root(adapter_key)
    for i in range(count):
        prev = chain_hash(prev, token_ids[i * block_size : (i + 1) * block_size])
        hashes.append(prev)
    return hashes
