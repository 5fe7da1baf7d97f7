"""The router's replica choice: prefix-aware (the endpoint picker's kind of score) with LoRA adapter
affinity, and least-load."""

from __future__ import annotations

import random

import pytest

from tokenmill_service.contract.block_hash import adapter_root, chain_hash, full_block_hashes
from tokenmill_service.front.router.choice import ADAPTER_AFFINITY, ReplicaChooser
from tokenmill_service.front.router.prefix_index import PrefixIndex

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


def test_a_cached_prefix_outweighs_load_in_proportion_to_the_prefill_it_saves() -> None:
    chooser = ReplicaChooser("prefix", BLOCK)
    conversation = prompt(7, 4000)  # a long conversation: 3984 tokens cached, 15.6 requests' worth
    first = chooser.choose(conversation, {0: 0, 1: 0})
    assert first is not None
    other = 1 - first
    for extra in range(1, 16):
        assert chooser.choose([*conversation, *prompt(extra, 20)], {first: extra, other: 0}) == first
    assert chooser.choose([*conversation, 5], {first: 16, other: 0}) == other
    # A short shared prefix (a 400-token system prompt: 1.5 requests' worth) keeps its replica for one more
    # request, not two; the other replica then holds it too, and the two share the load.
    system = prompt(8, 400)
    holder = chooser.choose(system, {0: 0, 1: 0})
    assert holder is not None
    assert chooser.choose([*system, *prompt(100, 20)], {holder: 1, 1 - holder: 0}) == holder
    assert chooser.choose([*system, *prompt(101, 20)], {holder: 2, 1 - holder: 0}) == 1 - holder


def test_eight_chats_with_one_system_prompt_spread_over_two_replicas() -> None:
    # Each chat in a closed loop (its next turn when its answer ends): both replicas carry four.
    chooser = ReplicaChooser("prefix", BLOCK)
    system = prompt(9, 300)
    running: dict[int, list[int]] = {0: [], 1: []}
    rng = random.Random(4)
    for turn in range(400):
        if turn >= 8:  # a chat's answer ends somewhere
            replica = rng.choice([r for r in running if running[r]])
            running[replica].pop()
        chosen = chooser.choose([*system, *prompt(1000 + turn, 40)], {r: len(running[r]) for r in running})
        assert chosen is not None
        running[chosen].append(turn)
        if turn >= 8:
            assert sorted(len(running[r]) for r in running) in ([4, 4], [3, 5]), (turn, running)


def test_unrelated_prompts_spread_over_idle_replicas() -> None:
    chooser = ReplicaChooser("prefix", BLOCK)
    chosen = [chooser.choose(prompt(i, 100), {0: 0, 1: 0, 2: 0}) for i in range(9)]
    assert sorted(chosen.count(r) for r in range(3)) == [3, 3, 3]
    # Concurrently: the least loaded wins.
    assert chooser.choose(prompt(99, 100), {0: 2, 1: 1, 2: 3}) == 1


def test_least_load_ignores_prefixes() -> None:
    chooser = ReplicaChooser("least-load", BLOCK)
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
    chooser = ReplicaChooser("prefix", BLOCK)
    chooser.replica_started(0, 100)
    chooser.replica_started(1, 100)
    system = prompt(7, 400)
    first = chooser.choose(system, {0: 0, 1: 0})
    assert first is not None
    chooser.replica_started(first, 100)
    assert chooser.choose(system, {first: 1, 1 - first: 0}) == 1 - first


class Replicas:
    """What the dispatcher tells the chooser: each replica's requests in flight, by adapter."""

    def __init__(self, chooser: ReplicaChooser, count: int) -> None:
        self.chooser = chooser
        self.running: dict[int, list[str]] = {r: [] for r in range(count)}

    def send(self, adapter: str, ids: list[int] | None = None) -> int:
        loads = {r: len(a) for r, a in self.running.items()}
        users = {r: a.count(adapter) for r, a in self.running.items()}
        chosen = self.chooser.choose(ids or [], loads, f"{adapter}#0" if adapter else "", users)
        assert chosen is not None
        self.running[chosen].append(adapter)
        return chosen

    def finish(self, replica: int, adapter: str) -> None:
        self.running[replica].remove(adapter)

    def adapters(self, replica: int) -> set[str]:
        return set(self.running[replica]) - {""}


def test_an_adapters_requests_go_where_it_already_runs() -> None:
    rng = random.Random(3)
    replicas = Replicas(ReplicaChooser("prefix", BLOCK), 2)
    # 64 streams over 8 adapters in a closed loop (a request ends, its stream sends the next one, on
    # the next adapter in turn): each replica's batch carries little more than half of the adapters, not all 8.
    for i in range(64):
        replicas.send(f"lora{i % 8}")
    carried = []
    for i in range(64, 2064):
        # Any request as likely as another to end.
        replica, adapter = rng.choice([(r, a) for r in (0, 1) for a in replicas.running[r]])
        replicas.finish(replica, adapter)
        replicas.send(f"lora{i % 8}")
        carried += [len(replicas.adapters(0)), len(replicas.adapters(1))]
        assert abs(len(replicas.running[0]) - len(replicas.running[1])) <= ADAPTER_AFFINITY + 1
    assert sum(carried) / len(carried) < 6  # 7.9 without affinity, 5.2 with


def test_affinity_yields_to_load_past_a_few_requests() -> None:
    chooser = ReplicaChooser("prefix", BLOCK)
    # Replica 0 runs the adapter: it takes the adapter's request while it runs fewer than
    # ADAPTER_AFFINITY requests more than replica 1, and no longer.
    for extra in range(ADAPTER_AFFINITY):
        assert chooser.choose([], {0: 10 + extra, 1: 10}, "a#0", {0: 3, 1: 0}) == 0
    assert chooser.choose([], {0: 10 + ADAPTER_AFFINITY, 1: 10}, "a#0", {0: 3, 1: 0}) == 1
    # Where both run it, the one running most of its requests is preferred, proportionally.
    assert chooser.choose([], {0: 10, 1: 10}, "a#0", {0: 4, 1: 1}) == 0
    assert chooser.choose([], {0: 13, 1: 10}, "a#0", {0: 4, 1: 1}) == 1
    # Its weight is in the units of the score: the same few requests whatever the batch size.
    small = ReplicaChooser("prefix", BLOCK)
    assert small.choose([], {0: 2 + ADAPTER_AFFINITY - 1, 1: 2}, "a#0", {0: 1, 1: 0}) == 0
    assert small.choose([], {0: 2 + ADAPTER_AFFINITY, 1: 2}, "a#0", {0: 1, 1: 0}) == 1


def test_one_adapter_that_every_request_uses_spreads_over_every_replica() -> None:
    replicas = Replicas(ReplicaChooser("prefix", BLOCK), 3)
    for i in range(60):
        replicas.send("only")
        loads = [len(replicas.running[r]) for r in range(3)]
        assert max(loads) - min(loads) <= ADAPTER_AFFINITY, (i, loads)
    assert sorted(len(replicas.running[r]) for r in range(3)) == [20, 20, 20]


def test_an_uneven_mix_stays_within_the_bound() -> None:
    rng = random.Random(5)
    replicas = Replicas(ReplicaChooser("prefix", BLOCK), 2)
    # A closed loop: most requests on one adapter, the rest on three others and the base model.
    weights = {"hot": 6, "b": 1, "c": 1, "d": 1, "": 1}
    names = list(weights)
    for _ in range(40):
        replicas.send(rng.choices(names, [weights[n] for n in names])[0])
    for _ in range(2000):
        replica = rng.choice([r for r in (0, 1) if replicas.running[r]])
        replicas.finish(replica, rng.choice(replicas.running[replica]))
        replicas.send(rng.choices(names, [weights[n] for n in names])[0])
        assert abs(len(replicas.running[0]) - len(replicas.running[1])) <= ADAPTER_AFFINITY + 1


def test_requests_on_the_base_model_are_routed_as_without_adapters() -> None:
    plain = ReplicaChooser("prefix", BLOCK)
    told = ReplicaChooser("prefix", BLOCK)
    system = prompt(7, 400)
    rng = random.Random(2)
    for i in range(50):
        ids = [*system, *prompt(i, 20)] if i % 3 else prompt(i, 60)
        loads = {0: rng.randrange(6), 1: rng.randrange(6)}
        assert plain.choose(ids, loads) == told.choose(ids, loads, "", {0: rng.randrange(3), 1: 0})
    # least-load never looks at adapters.
    least = ReplicaChooser("least-load", BLOCK)
    assert least.choose([], {0: 1, 1: 0}, "a#0", {0: 1, 1: 0}) == 1


def test_predicted_prefix_hits_are_keyed_by_adapter_as_the_workers_caches_are() -> None:
    ids = prompt(1, 50)
    # The block manager chains a sequence's first block from its adapter's root.
    assert full_block_hashes(ids, BLOCK, adapter_key="a#1")[0] == chain_hash(adapter_root("a#1"), ids[:16])
    assert not set(full_block_hashes(ids, BLOCK, adapter_key="a#1")) & set(full_block_hashes(ids, BLOCK))
    chooser = ReplicaChooser("prefix", BLOCK)
    system = prompt(7, 400)
    first = chooser.choose(system, {0: 0, 1: 0}, "a#0", {0: 0, 1: 0})
    assert first is not None
    other = 1 - first
    # The same prompt on another adapter, or on the base model, finds nothing cached on `first`...
    assert chooser.choose(system, {first: 1, other: 0}, "b#0", {first: 0, other: 0}) == other
    fresh = ReplicaChooser("prefix", BLOCK)
    first = fresh.choose(system, {0: 0, 1: 0}, "a#0", {0: 0, 1: 0})
    assert first is not None
    assert fresh.choose(system, {first: 1, 1 - first: 0}) == 1 - first
    # ...nor does the adapter loaded again (a new key), while the same adapter finds it.
    assert fresh.choose(system, {first: 1, 1 - first: 1}, "a#0", {first: 0, 1 - first: 0}) == first
    again = ReplicaChooser("prefix", BLOCK)
    first = again.choose(system, {0: 0, 1: 0}, "a#0", {0: 0, 1: 0})
    assert first is not None
    assert again.choose(system, {first: 1, 1 - first: 0}, "a#1", {first: 0, 1 - first: 0}) == 1 - first


def test_the_routing_flag() -> None:
    from tokenmill_service.contract.config import load_settings

    assert load_settings([], {}).routing == "prefix"
    assert load_settings(["--routing", "least-load"], {}).routing == "least-load"
    assert load_settings([], {"TOKENMILL_ROUTING": "least-load"}).routing == "least-load"
    with pytest.raises(SystemExit):
        load_settings(["--routing", "random"], {})
