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

A model that mixes windowed and global layers splits them into KV-cache groups
(worker/engine/kv_cache_groups.py): a sequence then has one block table per group (``group_windows``: each
group's window, None for a global group), all drawing from this one pool; a windowed group's table
frees the blocks behind the window as above, a global group's keeps them all. Each group's blocks are
cached under the same prefix hashes, per group: a prefix hit takes every group's blocks (a windowed
group's of the last window only), or none.

With an event log (``kv_events``), every block that enters the prefix cache (``BlockStored``) and
every cached block handed out again (``BlockRemoved``) is recorded, for ``--kv-events-endpoint``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from tokenmill_service.contract.block_hash import adapter_root, chain_hash
from tokenmill_service.worker.engine.kv_events import BlockRemoved, BlockStored, KVEventLog
from tokenmill_service.worker.engine.sequence import Sequence
from tokenmill_service.worker.kernels.attention_metadata import NULL_BLOCK


@dataclass(slots=True)
class Block:
    id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = ()
    group: int = 0  # the KV-cache group whose prefix cache holds it (while it has a hash)


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        kv_events: KVEventLog | None = None,
        window: int | None = None,
        group_windows: Seq[int | None] | None = None,
    ) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_queries = self.prefix_hits = 0
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Least recently freed first, so cached prefixes survive as long as possible. Ordered by a linked
        # list (OrderedDict): a prefix hit takes blocks from anywhere in it in constant time each.
        self.free_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        if group_windows is None:
            group_windows = (window,)
        # Per KV-cache group: whether its table frees the blocks behind the window (a windowed group).
        self.windowed = tuple(w is not None for w in group_windows)
        # The blocks of each group cached by prefix hash.
        self.cached: list[dict[int, int]] = [{} for _ in group_windows]
        # Blocks holding a hash that another block already holds in ``cached`` (two sequences computed the
        # same prefix at once): each stands in for that block when it is handed out again, so the prefix
        # stays found as long as one copy of it is in the pool.
        self.duplicates: list[dict[int, list[int]]] = [{} for _ in group_windows]
        # The group whose blocks the event log reports: a global one where there is one (its blocks are
        # kept whole, so what it reports is what a prefix hit needs).
        self.event_group = self.windowed.index(False) if False in self.windowed else 0
        self.kv_events = kv_events
        # Every windowed group's window is at most this many tokens (None: nothing is freed before the
        # sequence ends; setting it to None keeps every block).
        self.window = max((w for w in group_windows if w is not None), default=None)

    @property
    def num_groups(self) -> int:
        return len(self.windowed)

    @property
    def hash_to_block(self) -> dict[int, int]:
        """The reported group's cached blocks by prefix hash."""
        return self.cached[self.event_group]

    def _drops(self, group: int) -> bool:
        return self.window is not None and self.windowed[group]

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
        """The most blocks a windowed group's table holds at once (None: nothing is freed), computing at
        most ``chunk_tokens`` new tokens per step: those of the window before the chunk, and the chunk's."""
        if self.window is None:
            return None
        return -(-(self.window + chunk_tokens) // self.block_size) + 1

    def blocks_per_sequence(self, num_tokens: int, chunk_tokens: int) -> int:
        """The most blocks of the pool a sequence of ``num_tokens`` tokens holds at once: every group's
        table, a windowed group's bounded by its window (``window_blocks_per_sequence``)."""
        full = -(-num_tokens // self.block_size)
        windowed = self.window_blocks_per_sequence(chunk_tokens)
        return sum(
            min(full, windowed) if windowed is not None and self.windowed[g] else full for g in range(self.num_groups)
        )

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks `seq` needs so that its tables (one per group) cover `num_tokens` tokens."""
        want = (num_tokens + self.block_size - 1) // self.block_size
        return max(0, want - len(seq.block_table)) * self.num_groups

    def _tables(self, seq: Sequence) -> list[list[int]]:
        if not seq.block_tables:
            seq.block_tables = [[] for _ in range(self.num_groups)]
        return seq.block_tables

    def _take_free_block(self) -> int:
        block_id, _ = self.free_ids.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:
            self._uncache(block)
        block.hash, block.token_ids, block.ref_count, block.group = None, (), 1, 0
        return block_id

    def _uncache(self, block: Block) -> None:
        """``block`` is handed out again: its hash is found in another block holding it, or no longer."""
        assert block.hash is not None
        cached, duplicates = self.cached[block.group], self.duplicates[block.group]
        others = duplicates.get(block.hash)
        if cached.get(block.hash) != block.id:
            if others is not None and block.id in others:  # a duplicate goes: the cached copy stays
                others.remove(block.id)
                if not others:
                    del duplicates[block.hash]
            return
        if others:
            cached[block.hash] = others.pop(0)
            if not others:
                del duplicates[block.hash]
            return
        del cached[block.hash]
        if self.kv_events is not None and block.group == self.event_group:
            self.kv_events.events.append(BlockRemoved([block.hash]))

    def reuse_cached_prefix(self, seq: Sequence) -> None:
        """On admission: take the cached blocks of the longest matching full-block prefix.

        At least one token is always left to compute, since its logits give the next token.
        Sequences that want prompt logprobs take no hits: their logits must be computed.
        A windowed group needs only the blocks its window can see cached: the earlier ones (NULL_BLOCK)
        may have been handed out again, the chained hash of the last block vouches for every token
        before it. A group that keeps every block needs them all.
        """
        if not self.enable_prefix_caching or seq.block_tables or seq.collecting_prompt_logprobs:
            return
        max_blocks = (seq.num_tokens - 1) // self.block_size
        prev = adapter_root(seq.adapter_key)
        hashes: list[int] = []
        found: list[list[int | None]] = []  # per full block of the prompt: each group's cached block
        runs = [0] * self.num_groups  # per group: cached blocks in a row, ending at the last one looked up
        best = (0, 0)  # (blocks of the longest usable prefix, the first of them a windowed group needs)
        for i in range(max_blocks):
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            prev = chain_hash(prev, tokens)
            ids: list[int | None] = []
            for g, cached in enumerate(self.cached):
                block_id = cached.get(prev)
                if block_id is not None and self.blocks[block_id].token_ids != tokens:
                    block_id = None
                ids.append(block_id)
                runs[g] = runs[g] + 1 if block_id is not None else 0
            hashes.append(prev)
            found.append(ids)
            first = self._first_visible_block(i + 1)
            if all(run >= i + 1 - (first if self._drops(g) else 0) for g, run in enumerate(runs)):
                best = (i + 1, first)
            elif any(run < i + 1 and not self._drops(g) for g, run in enumerate(runs)):
                break  # a group that keeps every block misses one: no longer prefix can be taken
        blocks, first = best
        tables = self._tables(seq)
        for g, table in enumerate(tables):
            skip = first if self._drops(g) else 0
            table[:] = [NULL_BLOCK] * skip
            for ids in found[skip:blocks]:
                block_id = ids[g]
                assert block_id is not None
                block = self.blocks[block_id]
                if block.ref_count == 0:
                    del self.free_ids[block_id]
                block.ref_count += 1
                table.append(block_id)
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
        tables = self._tables(seq)
        for _ in range(need // self.num_groups):
            for table in tables:
                table.append(self._take_free_block())
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
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            block_hash = chain_hash(prev, tokens)
            for g, table in enumerate(seq.block_tables):
                block = self.blocks[table[i]]
                if block.hash is not None:
                    continue  # taken from the prefix cache: already this hash
                block.hash, block.token_ids, block.group = block_hash, tokens, g
                if self.cached[g].setdefault(block_hash, block.id) != block.id:
                    self.duplicates[g].setdefault(block_hash, []).append(block.id)
                    continue
                if g == self.event_group and self.kv_events is not None:
                    if stored is None or stored.block_hashes[-1] != prev:
                        stored = BlockStored([], prev, [], self.block_size)
                        self.kv_events.events.append(stored)
                    stored.block_hashes.append(block_hash)
                    stored.token_ids.extend(tokens)
            seq.block_hashes.append(block_hash)
            prev = block_hash

    def drop_blocks_behind_window(self, seq: Sequence) -> None:
        """Free the blocks of ``seq`` that no query of its can see any more: its next query (at
        ``num_computed_tokens``; speculative drafts and prefill chunks come after it) sees keys from
        ``num_computed_tokens - window + 1`` on, so the blocks wholly before that are done with."""
        if self.window is None:
            return
        upto = min(max(seq.num_computed_tokens - self.window + 1, 0) // self.block_size, len(seq.block_table))
        for g, table in enumerate(seq.block_tables):
            if self._drops(g):
                for i in range(seq.num_dropped_blocks, upto):
                    self._release(table[i])
                    table[i] = NULL_BLOCK
        seq.num_dropped_blocks = max(seq.num_dropped_blocks, upto)

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_ids[block_id] = None

    def free(self, seq: Sequence) -> None:
        """Return the sequence's blocks to the pool at once (finished, cancelled or preempted)."""
        for table in seq.block_tables:
            for block_id in reversed(table):
                if block_id != NULL_BLOCK:
                    self._release(block_id)
        seq.block_tables, seq.block_hashes, seq.num_dropped_blocks = [], [], 0
