"""The router's replica choice: prefix-aware (the endpoint picker's kind of score) and least-load."""

from __future__ import annotations

import random

import pytest

from tokenmill_service.engine.block_hash import chain_hash, full_block_hashes
from tokenmill_service.router.choice import ReplicaChooser
from tokenmill_service.router.prefix_index import PrefixIndex

BLOCK = 16


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(length)]


def test_block_hashes_chain_whole_blocks_and_agree_with_the_block_managers() -> None:
    ids = prompt(1, 50)
    hashes = full_block_hashes(ids, BLOCK)
    assert len(hashes) == 3  # the 2 tokens past the last full block are not hashed
    assert hashes[0] == chain_hash(None, ids[:16])
    assert hashes[2] == chain_hash(chain_hash(chain_hash(None, ids[:16]), ids[16:32]), ids[32:48])
    # A prefix's hashes are the start of the longer prompt's; a change early changes every later hash.
    assert full_block_hashes(ids[:40], BLOCK) == hashes[:2]
    changed = [ids[0] + 1, *ids[1:]]
    assert not set(full_block_hashes(changed, BLOCK)) & set(hashes)


def test_requests_sharing_a_long_prefix_go_to_the_replica_that_holds_it() -> None:
    chooser = ReplicaChooser("prefix", BLOCK, max_batch_size=8)
    system = prompt(7, 400)
    first = chooser.choose([*system, *prompt(100, 20)], {0: 0, 1: 0})
    assert first is not None
    other = 1 - first
    # Even while it runs a few more requests than the other replica.
    for i in range(5):
        assert chooser.choose([*system, *prompt(200 + i, 20)], {first: i + 1, other: 0}) == first


def test_a_full_batch_outweighs_a_cached_prefix() -> None:
    chooser = ReplicaChooser("prefix", BLOCK, max_batch_size=4)
    system = prompt(7, 400)
    first = chooser.choose(system, {0: 0, 1: 0})
    assert first is not None
    # The holder runs a whole batch and more: the other replica takes the request (and now holds it too).
    assert chooser.choose(system, {first: 5, 1 - first: 0}) == 1 - first


def test_unrelated_prompts_spread_over_idle_replicas() -> None:
    chooser = ReplicaChooser("prefix", BLOCK, max_batch_size=8)
    chosen = [chooser.choose(prompt(i, 100), {0: 0, 1: 0, 2: 0}) for i in range(9)]
    assert sorted(chosen.count(r) for r in range(3)) == [3, 3, 3]
    # Concurrently: the least loaded wins.
    assert chooser.choose(prompt(99, 100), {0: 2, 1: 1, 2: 3}) == 1


def test_least_load_ignores_prefixes() -> None:
    chooser = ReplicaChooser("least-load", BLOCK, max_batch_size=8)
    system = prompt(7, 400)
    assert chooser.choose(system, {0: 0, 1: 0}) == 0
    assert chooser.choose(system, {0: 1, 1: 0}) == 1


def test_the_index_is_bounded_and_a_restarted_replica_holds_nothing() -> None:
    index = PrefixIndex()
    index.reset(0, capacity=10)
    hashes = full_block_hashes(prompt(3, 16 * 8), BLOCK)
    other = full_block_hashes(prompt(4, 16 * 8), BLOCK)
    index.record(0, hashes)
    assert index.matched(0, hashes) == 8
    index.record(0, other)  # 16 blocks sent, 10 kept: the oldest six of the first prompt are gone
    assert index.size(0) == 10
    assert index.matched(0, other) == 8
    assert index.matched(0, hashes) == 0
    index.reset(0, capacity=10)
    assert index.matched(0, other) == 0
    # Through the chooser: a restart clears the replica's entry, so the prefix no longer pulls there.
    chooser = ReplicaChooser("prefix", BLOCK, max_batch_size=8)
    chooser.replica_started(0, 100)
    chooser.replica_started(1, 100)
    system = prompt(7, 400)
    first = chooser.choose(system, {0: 0, 1: 0})
    assert first is not None
    chooser.replica_started(first, 100)
    assert chooser.choose(system, {first: 1, 1 - first: 0}) == 1 - first


def test_the_routing_flag() -> None:
    from tokenmill_service.config import load_settings

    assert load_settings([], {}).routing == "prefix"
    assert load_settings(["--routing", "least-load"], {}).routing == "least-load"
    assert load_settings([], {"TOKENMILL_ROUTING": "least-load"}).routing == "least-load"
    with pytest.raises(SystemExit):
        load_settings(["--routing", "random"], {})
