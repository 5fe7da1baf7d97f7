"""The paged KV cache's bookkeeping: fixed-size blocks, reference counts, shared prefixes.

A sequence owns a block table (the ids of its blocks, in order). Blocks come from one pool
sized at start-up. A full block is identified by the hash of its tokens and of everything
before it (from the sequence's LoRA adapter on), so two requests with the same prompt prefix share those blocks (prefix caching).
A freed block keeps its hash until it is handed out again: a later request with the same
prefix can take it back without recomputing.

When every layer attends within a sliding window (``window``: the widest of them), a sequence keeps only
the blocks its next queries can see: a block wholly before the window of its next position is freed
as soon as it is computed (its table slot holds ``NULL_BLOCK``, which the attention kernels read as
block 0 and mask, as they do padding), so a sequence of any length holds at most
``window_blocks_per_sequence`` blocks. A freed block keeps its hash like any other, and a later
request with the same prefix needs only the blocks of its last window still cached to take it.

With an event log (``kv_events``), every block that enters the prefix cache (``BlockStored``) and
every cached block handed out again (``BlockRemoved``) is recorded, for ``--kv-events-endpoint``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from tokenmill_service.engine.block_hash import adapter_root, chain_hash
from tokenmill_service.engine.kv_events import BlockRemoved, BlockStored, KVEventLog
from tokenmill_service.engine.sequence import Sequence
from tokenmill_service.kernels.attention_metadata import NULL_BLOCK


@dataclass(slots=True)
class Block:
    id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = ()


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        kv_events: KVEventLog | None = None,
        window: int | None = None,
    ) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_queries = self.prefix_hits = 0
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Least recently freed first, so cached prefixes survive as long as possible.
        self.free_ids: deque[int] = deque(range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.kv_events = kv_events
        # Every layer's sliding window is at most this many tokens (None: some layer sees the whole context).
        self.window = window

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def window_blocks_per_sequence(self, chunk_tokens: int) -> int | None:
        """The most blocks a sequence holds at once when every layer is windowed (None: its whole
        context), computing at most ``chunk_tokens`` new tokens per step: those of the window before
        the chunk, and the chunk's."""
        if self.window is None:
            return None
        return -(-(self.window + chunk_tokens) // self.block_size) + 1

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks `seq` needs so that its table covers `num_tokens` tokens."""
        want = (num_tokens + self.block_size - 1) // self.block_size
        return max(0, want - len(seq.block_table))

    def _take_free_block(self) -> int:
        block_id = self.free_ids.popleft()
        block = self.blocks[block_id]
        if block.hash is not None and self.hash_to_block.get(block.hash) == block_id:
            del self.hash_to_block[block.hash]
            if self.kv_events is not None:
                self.kv_events.events.append(BlockRemoved([block.hash]))
        block.hash, block.token_ids, block.ref_count = None, (), 1
        return block_id

    def reuse_cached_prefix(self, seq: Sequence) -> None:
        """On admission: take the cached blocks of the longest matching full-block prefix.

        At least one token is always left to compute, since its logits give the next token.
        Sequences that want prompt logprobs take no hits: their logits must be computed.
        With every layer windowed, a prefix needs only the blocks its window can see cached: the
        earlier ones (NULL_BLOCK) may have been handed out again, the chained hash of the last block
        vouches for every token before it.
        """
        if not self.enable_prefix_caching or seq.block_table or seq.collecting_prompt_logprobs:
            return
        max_blocks = (seq.num_tokens - 1) // self.block_size
        prev = adapter_root(seq.adapter_key)
        hashes: list[int] = []
        found: list[int | None] = []  # the cached block of each full block of the prompt
        run = 0  # cached blocks in a row, ending at the last one looked up
        best = (0, 0)  # (blocks of the longest usable prefix, the first of them that must be cached)
        for i in range(max_blocks):
            tokens = seq.token_ids[i * self.block_size : (i + 1) * self.block_size]
            prev = chain_hash(prev, tokens)
            block_id = self.hash_to_block.get(prev)
            if block_id is not None and self.blocks[block_id].token_ids != tuple(tokens):
                block_id = None
            hashes.append(prev)
            found.append(block_id)
            run = run + 1 if block_id is not None else 0
            first = self._first_visible_block(i + 1)
            if run >= i + 1 - first:
                best = (i + 1, first)
            elif self.window is None:
                break  # without windows every block of the prefix is needed: no longer one can be
        blocks, first = best
        seq.block_table = [NULL_BLOCK] * first
        for block_id in found[first:blocks]:
            assert block_id is not None
            block = self.blocks[block_id]
            if block.ref_count == 0:
                self.free_ids.remove(block_id)
            block.ref_count += 1
            seq.block_table.append(block_id)
        seq.block_hashes, seq.num_dropped_blocks = hashes[:blocks], first
        seq.num_computed_tokens = seq.num_cached_tokens = blocks * self.block_size
        # For the prefix-cache hit rate: tokens looked up, tokens found.
        self.prefix_queries += seq.num_tokens
        self.prefix_hits += seq.num_cached_tokens

    def _first_visible_block(self, num_blocks: int) -> int:
        """The first block a query right after ``num_blocks`` full blocks sees (0 without windows)."""
        if self.window is None:
            return 0
        return max(num_blocks * self.block_size - self.window + 1, 0) // self.block_size

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow `seq`'s table to cover `num_tokens` tokens; all or nothing."""
        need = self.blocks_needed(seq, num_tokens)
        if need > self.num_free_blocks:
            return False
        for _ in range(need):
            seq.block_table.append(self._take_free_block())
        return True

    def register_computed_blocks(self, seq: Sequence) -> None:
        """After a step computed more of ``seq``: give its newly completed blocks their prefix hashes
        (for later sharing), then free those every layer's window has left behind."""
        if self.enable_prefix_caching:
            self._hash_full_blocks(seq)
        self.drop_blocks_behind_window(seq)

    def _hash_full_blocks(self, seq: Sequence) -> None:
        full = seq.num_computed_tokens // self.block_size
        prev = seq.block_hashes[-1] if seq.block_hashes else adapter_root(seq.adapter_key)
        stored: BlockStored | None = None  # the run of blocks this call adds to the cache, for the event log
        for i in range(len(seq.block_hashes), full):
            block = self.blocks[seq.block_table[i]]
            if block.hash is None:
                tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
                block.hash, block.token_ids = chain_hash(prev, tokens), tokens
                if self.hash_to_block.setdefault(block.hash, block.id) == block.id and self.kv_events is not None:
                    if stored is None or stored.block_hashes[-1] != prev:
                        stored = BlockStored([], prev, [], self.block_size)
                        self.kv_events.events.append(stored)
                    stored.block_hashes.append(block.hash)
                    stored.token_ids.extend(tokens)
            seq.block_hashes.append(block.hash)
            prev = block.hash

    def drop_blocks_behind_window(self, seq: Sequence) -> None:
        """Free the blocks of ``seq`` that no query of its can see any more: its next query (at
        ``num_computed_tokens``; speculative drafts and prefill chunks come after it) sees keys from
        ``num_computed_tokens - window + 1`` on, so the blocks wholly before that are done with."""
        if self.window is None:
            return
        upto = min(max(seq.num_computed_tokens - self.window + 1, 0) // self.block_size, len(seq.block_table))
        for i in range(seq.num_dropped_blocks, upto):
            self._release(seq.block_table[i])
            seq.block_table[i] = NULL_BLOCK
        seq.num_dropped_blocks = max(seq.num_dropped_blocks, upto)

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_ids.append(block_id)

    def free(self, seq: Sequence) -> None:
        """Return the sequence's blocks to the pool at once (finished, cancelled or preempted)."""
        for block_id in reversed(seq.block_table):
            if block_id != NULL_BLOCK:
                self._release(block_id)
        seq.block_table, seq.block_hashes, seq.num_dropped_blocks = [], [], 0
