"""The paged KV cache's block allocator: allocate, grow, free, share prefixes, never leak."""

from __future__ import annotations

import random
from typing import Any

import pytest

from tokenmill_service.contract.request import GenerationRequest
from tokenmill_service.worker.engine.block_manager import BlockManager
from tokenmill_service.worker.engine.sequence import Sequence
from tokenmill_service.worker.kernels.attention_metadata import NULL_BLOCK


def make_seq(tokenizer: Any, ids: list[int], rid: str = "r", prompt_logprobs: bool = False) -> Sequence:
    return Sequence(GenerationRequest(rid, ids, prompt_logprobs=prompt_logprobs), tokenizer)


def test_allocate_covers_the_tokens_and_grows_one_block_at_a_time(default_tokenizer: Any) -> None:
    bm = BlockManager(num_blocks=10, block_size=4)
    seq = make_seq(default_tokenizer, list(range(10)))
    assert bm.allocate(seq, 10)
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 7
    assert bm.allocate(seq, 12) and len(seq.block_table) == 3  # still fits in block 3
    assert bm.allocate(seq, 13) and len(seq.block_table) == 4


def test_allocation_is_all_or_nothing(default_tokenizer: Any) -> None:
    bm = BlockManager(num_blocks=2, block_size=4)
    seq = make_seq(default_tokenizer, list(range(12)))
    assert not bm.allocate(seq, 12)
    assert seq.block_table == [] and bm.num_free_blocks == 2


def test_free_returns_every_block(default_tokenizer: Any) -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(default_tokenizer, list(range(20)))
    assert bm.allocate(seq, 20)
    bm.free(seq)
    assert bm.num_free_blocks == 8 and seq.block_table == []


def test_shared_prefix_blocks_are_reused_and_counted(default_tokenizer: Any) -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    prefix = list(range(100, 112))  # three full blocks
    a = make_seq(default_tokenizer, prefix + [1, 2], "a")
    assert bm.allocate(a, a.num_tokens)
    a.num_computed_tokens = a.num_tokens
    bm.register_computed_blocks(a)

    b = make_seq(default_tokenizer, prefix + [7, 8, 9], "b")
    bm.reuse_cached_prefix(b)
    assert b.block_table == a.block_table[:3]
    assert b.num_computed_tokens == 12
    assert all(bm.blocks[i].ref_count == 2 for i in b.block_table)
    bm.free(a)
    assert all(bm.blocks[i].ref_count == 1 for i in b.block_table)
    bm.free(b)
    assert bm.num_free_blocks == 16


def test_a_freed_prefix_can_be_taken_back(default_tokenizer: Any) -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq(default_tokenizer, list(range(9)), "a")
    assert bm.allocate(a, 9)
    a.num_computed_tokens = 9
    bm.register_computed_blocks(a)
    first_two = a.block_table[:2]
    bm.free(a)
    b = make_seq(default_tokenizer, list(range(9)), "b")
    bm.reuse_cached_prefix(b)
    assert b.block_table == first_two and bm.num_free_blocks == 6


def test_a_prefix_computed_twice_at_once_is_found_while_either_copy_is_in_the_pool(default_tokenizer: Any) -> None:
    # Regression: the second copy of a prefix computed by two sequences in the same steps was never
    # entered in the cache, so once the first copy's blocks were handed out again the prefix was lost
    # although the second copy still held it.
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = (make_seq(default_tokenizer, list(range(9)), rid) for rid in "ab")
    for seq in (a, b):
        assert bm.allocate(seq, 9)
    for seq in (a, b):
        seq.num_computed_tokens = 9
        bm.register_computed_blocks(seq)
    first, second = list(a.block_table), list(b.block_table)
    bm.free(a)
    bm.free(b)
    filler = make_seq(default_tokenizer, [500 + i for i in range(20)], "filler")
    assert bm.allocate(filler, 20)  # the two never used, then a's three: the least recently freed
    assert set(first) <= set(filler.block_table)
    c = make_seq(default_tokenizer, list(range(9)), "c")
    bm.reuse_cached_prefix(c)
    assert c.num_computed_tokens == 8 and c.block_table == second[:2]
    # Both copies handed out: the prefix is gone, and no stale entry points at a reused block.
    bm.free(c)
    bm.free(filler)
    other = make_seq(default_tokenizer, [700 + i for i in range(32)], "other")
    assert bm.allocate(other, 32)
    d = make_seq(default_tokenizer, list(range(9)), "d")
    bm.reuse_cached_prefix(d)
    assert d.num_computed_tokens == 0 and not bm.cached[0] and not bm.duplicates[0]


def test_prefix_reuse_always_leaves_a_token_to_compute(default_tokenizer: Any) -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq(default_tokenizer, list(range(8)), "a")
    assert bm.allocate(a, 8)
    a.num_computed_tokens = 8
    bm.register_computed_blocks(a)
    b = make_seq(default_tokenizer, list(range(8)), "b")
    bm.reuse_cached_prefix(b)
    assert b.num_computed_tokens == 4  # the last block is recomputed to get its logits


def test_prompt_logprob_requests_take_no_cached_blocks(default_tokenizer: Any) -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq(default_tokenizer, list(range(9)), "a")
    assert bm.allocate(a, 9)
    a.num_computed_tokens = 9
    bm.register_computed_blocks(a)
    b = make_seq(default_tokenizer, list(range(9)), "b", prompt_logprobs=True)
    bm.reuse_cached_prefix(b)
    assert b.block_table == [] and b.num_computed_tokens == 0


@pytest.mark.parametrize("seed", range(5))
def test_no_block_leaks_under_random_operations(default_tokenizer: Any, seed: int) -> None:
    rng = random.Random(seed)
    bm = BlockManager(num_blocks=32, block_size=4)
    live: list[Sequence] = []
    for step in range(400):
        op = rng.random()
        if op < 0.4 or not live:
            prefix = [rng.randrange(3) for _ in range(rng.randrange(1, 12))]
            seq = make_seq(default_tokenizer, prefix, f"s{step}")
            bm.reuse_cached_prefix(seq)
            if bm.allocate(seq, seq.num_tokens):
                seq.num_computed_tokens = seq.num_tokens
                bm.register_computed_blocks(seq)
                live.append(seq)
            else:
                bm.free(seq)
        elif op < 0.8:
            seq = rng.choice(live)
            seq.token_ids.append(rng.randrange(3))
            if bm.allocate(seq, seq.num_tokens):
                seq.num_computed_tokens = seq.num_tokens
                bm.register_computed_blocks(seq)
            else:  # preempted: everything goes back
                bm.free(seq)
                live.remove(seq)
        else:
            seq = live.pop(rng.randrange(len(live)))
            bm.free(seq)
        # Invariants: reference counts equal the number of tables that hold each block.
        held: dict[int, int] = {}
        for s in live:
            for b in s.block_table:
                held[b] = held.get(b, 0) + 1
        for block in bm.blocks:
            assert block.ref_count == held.get(block.id, 0)
        assert bm.num_free_blocks == sum(1 for b in bm.blocks if b.ref_count == 0)
        # Every block with a hash is found under it, once: the cached copy or one of its duplicates.
        listed = [(h, i) for h, i in bm.cached[0].items()]
        listed += [(h, i) for h, ids in bm.duplicates[0].items() for i in ids]
        assert sorted(listed) == sorted((b.hash, b.id) for b in bm.blocks if b.hash is not None)
    for s in live:
        bm.free(s)
    assert bm.num_free_blocks == bm.num_blocks


def test_a_windowed_sequence_frees_the_blocks_behind_its_window_and_keeps_a_shared_one(
    default_tokenizer: Any,
) -> None:
    bm = BlockManager(num_blocks=16, block_size=4, window=8)
    prefix = list(range(100, 112))  # three full blocks
    a = make_seq(default_tokenizer, prefix + [1, 2], "a")
    assert bm.allocate(a, a.num_tokens)
    shared = a.block_table[:3]
    a.num_computed_tokens = a.num_tokens
    bm.register_computed_blocks(a)  # a's next query (14) sees 7 on: its block 0 (0-3) is freed, hash kept
    assert a.block_table[0] == NULL_BLOCK and bm.blocks[shared[0]].ref_count == 0
    b = make_seq(default_tokenizer, prefix + [7, 8, 9], "b")
    bm.reuse_cached_prefix(b)  # all three blocks found; b's next query (12) sees 5 on: block 0 freed again
    assert b.block_table == [NULL_BLOCK, *shared[1:]] and b.num_dropped_blocks == 1 and b.num_computed_tokens == 12
    assert [bm.blocks[i].ref_count for i in shared] == [0, 2, 2]

    # a grows to 30 tokens: its next query (30) sees 23 on, so blocks 0-4 (0-19) are freed.
    a.token_ids += list(range(16))
    assert bm.allocate(a, a.num_tokens)
    a.num_computed_tokens = a.num_tokens
    bm.register_computed_blocks(a)
    assert a.block_table[:5] == [NULL_BLOCK] * 5 and NULL_BLOCK not in a.block_table[5:]
    assert len(a.block_hashes) == 7  # every full block hashed, dropped ones too
    assert bm.blocks[shared[0]].ref_count == 0 and bm.blocks[shared[1]].ref_count == 1  # b's
    assert bm.num_used_blocks == 5  # a's blocks 5-7, and b's 1-2 (a's once)
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 16 and (a.block_table, a.block_hashes, a.num_dropped_blocks) == ([], [], 0)
    # The freed blocks keep their hashes: a request with a's first 28 tokens finds all 7 full blocks.
    c = make_seq(default_tokenizer, a.token_ids[:29], "c")
    bm.reuse_cached_prefix(c)
    assert c.num_computed_tokens == 28 and c.block_table[:5] == [NULL_BLOCK] * 5


def test_a_windowed_prefix_is_found_while_only_its_window_is_cached(default_tokenizer: Any) -> None:
    bm = BlockManager(num_blocks=12, block_size=4, window=8)
    prompt = list(range(100, 141))  # 41 tokens: 10 full blocks
    a = make_seq(default_tokenizer, prompt, "a")
    for upto in range(8, 41, 8):  # prefilled in chunks of 8, its blocks behind the window freed as it goes
        assert bm.allocate(a, upto)
        a.num_computed_tokens = upto
        bm.register_computed_blocks(a)
    hashes = list(a.block_hashes)
    bm.free(a)
    # Another request takes blocks until a's first one is handed out: a's oldest blocks go first.
    z = make_seq(default_tokenizer, list(range(200, 260)), "z")
    while bm.hash_to_block.get(hashes[0]) is not None:
        assert bm.allocate(z, (len(z.block_table) + 1) * 4)
    assert all(h in bm.hash_to_block for h in hashes[-2:])  # the last window's blocks: 33-40 sees 26 on

    c = make_seq(default_tokenizer, prompt, "c")
    bm.reuse_cached_prefix(c)
    # The query at 40 sees keys 33-40: blocks 8 and 9 (32-39) and the one it computes; 0-7 are not needed.
    assert c.num_computed_tokens == 40 and c.block_table[:8] == [NULL_BLOCK] * 8
    assert [bm.hash_to_block[h] for h in hashes[8:]] == c.block_table[8:] and c.block_hashes == hashes

    plain = BlockManager(num_blocks=12, block_size=4)  # without windows a missing first block is a miss
    d = make_seq(default_tokenizer, prompt, "d")
    assert plain.allocate(d, 40)
    d.num_computed_tokens = 40
    plain.register_computed_blocks(d)
    first = d.block_hashes[0]
    plain.free(d)
    plain.hash_to_block.pop(first)  # as if handed out again
    e = make_seq(default_tokenizer, prompt, "e")
    plain.reuse_cached_prefix(e)
    assert e.num_computed_tokens == 0 and e.block_table == []


def test_a_windowed_and_a_global_group_share_the_pool_and_a_prefix_hit_needs_both(default_tokenizer: Any) -> None:
    # Two KV-cache groups (worker/engine/kv_cache_groups.py): the first windowed (8 tokens), the second global.
    bm = BlockManager(num_blocks=24, block_size=4, group_windows=(8, None))
    assert bm.num_groups == 2 and bm.windowed == (True, False) and bm.hash_to_block is bm.cached[1]
    prompt = list(range(100, 125))  # 25 tokens: 6 full blocks
    a = make_seq(default_tokenizer, prompt, "a")
    assert bm.blocks_needed(a, 25) == 14 and bm.allocate(a, 25)  # 7 blocks in each group's table
    assert [len(t) for t in a.block_tables] == [7, 7] and not set(a.block_tables[0]) & set(a.block_tables[1])
    a.num_computed_tokens = 25
    bm.register_computed_blocks(a)  # its next query (25) sees 18 on: the windowed table frees blocks 0-3
    local, global_ = a.block_tables
    assert local[:4] == [NULL_BLOCK] * 4 and NULL_BLOCK not in local[4:] + global_
    assert bm.num_used_blocks == 3 + 7 and bm.blocks_per_sequence(25, 8) == (-(-16 // 4) + 1) + 7
    hashes = list(a.block_hashes)
    bm.free(a)
    assert bm.num_free_blocks == 24

    # The same prompt again: the global group's six blocks and the windowed group's last window (blocks 4-5).
    b = make_seq(default_tokenizer, prompt, "b")
    bm.reuse_cached_prefix(b)
    assert b.num_computed_tokens == 24 and b.num_dropped_blocks == 4
    assert b.block_tables == [[NULL_BLOCK] * 4 + local[4:6], global_[:6]]
    bm.free(b)

    # The global group's first block handed out again (put first in line): no prefix can be taken,
    # though every windowed block it would need is still cached.
    bm.free_ids.move_to_end(global_[0], last=False)
    z = make_seq(default_tokenizer, list(range(300, 304)), "z")
    assert bm.allocate(z, 4) and hashes[0] not in bm.cached[1]
    assert all(bm.cached[0].get(h) == i for h, i in zip(hashes[4:6], local[4:6]))
    c = make_seq(default_tokenizer, prompt, "c")
    bm.reuse_cached_prefix(c)
    assert c.num_computed_tokens == 0 and c.block_tables == [[], []]
