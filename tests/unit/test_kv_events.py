"""KV-cache events: the block manager's stores and evictions, published over ZMQ in vLLM's format and
decoded by an independent subscriber (pyzmq + msgpack against vLLM's array-like schema)."""

from __future__ import annotations

import socket
from typing import Any

import msgpack
import pytest
import zmq

from tokenmill_service.contract.block_hash import chain_hash, full_block_hashes
from tokenmill_service.contract.request import GenerationRequest
from tokenmill_service.worker.engine.block_manager import BlockManager
from tokenmill_service.worker.engine.kv_events import AllBlocksCleared, KVEventLog, KVEventPublisher, offset_endpoint
from tokenmill_service.worker.engine.sequence import Sequence

BLOCK = 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def check_batch(frames: list[bytes], topic: bytes) -> tuple[int, float, list[list[Any]], int]:
    """One message against vLLM's schema: topic, 8-byte big-endian sequence, [ts, [events], dp_rank]."""
    assert len(frames) == 3 and frames[0] == topic and len(frames[1]) == 8
    batch = msgpack.unpackb(frames[2])
    assert isinstance(batch, list) and len(batch) == 3
    ts, events, rank = batch
    assert isinstance(ts, float) and isinstance(events, list) and isinstance(rank, int)
    for event in events:
        match event:
            case ["BlockStored", hashes, parent, tokens, size, None, medium, None]:
                assert all(isinstance(h, int) for h in hashes) and (parent is None or isinstance(parent, int))
                assert len(tokens) == len(hashes) * size and medium == "CPU"
            case ["BlockRemoved", hashes, "CPU"]:
                assert hashes and all(isinstance(h, int) for h in hashes)
            case ["AllBlocksCleared"]:
                pass
            case _:
                raise AssertionError(f"not one of vLLM's KV events: {event!r}")
    return int.from_bytes(frames[1], "big"), ts, events, rank


def seq(tokenizer: Any, ids: list[int], rid: str) -> Sequence:
    return Sequence(GenerationRequest(rid, ids), tokenizer)


def compute(bm: BlockManager, s: Sequence) -> None:
    """What a step does for the block manager: take cached blocks, allocate the rest, register them."""
    bm.reuse_cached_prefix(s)
    assert bm.allocate(s, s.num_tokens)
    s.num_computed_tokens = s.num_tokens
    bm.register_computed_blocks(s)


def test_a_subscriber_rebuilds_the_prefix_cache_from_the_published_events(default_tokenizer: Any) -> None:
    port = free_port()
    log = KVEventLog()
    bm = BlockManager(num_blocks=6, block_size=BLOCK, kv_events=log)
    publisher = KVEventPublisher(f"tcp://*:{port}", rank=0, topic="kv@test", medium="CPU")
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.connect(f"tcp://127.0.0.1:{port}")
    try:
        # The subscription travels asynchronously: announce a cleared cache until one is heard.
        while not sub.poll(50):
            publisher.publish([AllBlocksCleared()])
        sub.recv_multipart()
        while sub.poll(0):
            sub.recv_multipart()

        shared = list(range(100, 108))  # two full blocks
        a = seq(default_tokenizer, [*shared, 1, 2, 3, 4, 5], "a")  # three full blocks
        compute(bm, a)
        publisher.publish(log.drain())
        b = seq(default_tokenizer, [*shared, 9, 9, 9, 9, 9], "b")  # shares two blocks, adds one
        compute(bm, b)
        publisher.publish(log.drain())
        bm.free(a)
        bm.free(b)
        # Unrelated prompts that need the whole pool: cached blocks are handed out again (evicted).
        for i in range(3):
            c = seq(default_tokenizer, [50 + i] * 17, f"c{i}")
            compute(bm, c)
            publisher.publish(log.drain())
            bm.free(c)

        held: set[int] = set()
        stored_runs = []
        seqs = []
        while sub.poll(2000):
            number, _, events, rank = check_batch(sub.recv_multipart(), b"kv@test")
            seqs.append(number)
            assert rank == 0
            for event in events:
                match event:
                    case ["BlockStored", hashes, parent, tokens, size, *_]:
                        # The hashes follow from the tokens and the parent alone.
                        prev = parent
                        for i, h in enumerate(hashes):
                            assert h == chain_hash(prev, tokens[i * size : (i + 1) * size])
                            prev = h
                        held.update(hashes)
                        stored_runs.append((hashes, parent, tokens))
                    case ["BlockRemoved", hashes, _]:
                        assert set(hashes) <= held
                        held.difference_update(hashes)
            if len(seqs) == 5:
                break
        assert seqs == sorted(seqs) and len(seqs) == 5
        a_hashes = full_block_hashes(a.token_ids, BLOCK)
        assert stored_runs[0] == (a_hashes, None, a.token_ids[:12])
        # b's first two blocks were a's: only its third is new, chained to a's second.
        b_hashes = full_block_hashes(b.token_ids, BLOCK)
        assert stored_runs[1] == ([b_hashes[2]], a_hashes[1], b.token_ids[8:12])
        # Evictions happened, and the subscriber's view is the block manager's cache exactly.
        assert not set(a_hashes) <= held
        assert held == set(bm.hash_to_block)
    finally:
        sub.close(linger=0)
        publisher.close()


def test_worker_n_publishes_on_the_port_plus_n() -> None:
    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint("ipc:///tmp/kv", 1) == "ipc:///tmp/kv_dp1"


def test_the_endpoint_flag_takes_zmq_endpoints_only() -> None:
    from tokenmill_service.contract.config import load_settings

    assert load_settings(["--kv-events-endpoint", "tcp://*:5557"], {}).kv_events_endpoint == "tcp://*:5557"
    env = {"TOKENMILL_KV_EVENTS_ENDPOINT": "ipc:///tmp/kv", "TOKENMILL_KV_EVENTS_TOPIC": "kv@pod@model"}
    settings = load_settings([], env)
    assert (settings.kv_events_endpoint, settings.kv_events_topic) == ("ipc:///tmp/kv", "kv@pod@model")
    for bad in ("5557", "tcp://*", "http://host:5557"):
        with pytest.raises(ValueError, match="--kv-events-endpoint"):
            load_settings(["--kv-events-endpoint", bad], {})
