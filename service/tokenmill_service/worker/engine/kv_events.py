"""KV-cache events: what the block manager stores in and evicts from its prefix cache, published in
vLLM's format (``--kv-events-endpoint``) for KV-cache-aware routers (llm-d's KV-cache indexer,
Dynamo's KV router).

The wire format is vLLM's (``vllm/distributed/kv_events.py``, its msgspec structs with
``array_like=True``, as in its 0.10-0.11 releases and as llm-d's decoders read it): each ZMQ message
is three frames, ``topic``, an 8-byte big-endian sequence number and a msgpack payload, the batch::

    [ts, [event, ...], data_parallel_rank]

with each event an array tagged by its type name, trailing defaults left out::

    ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name]
    ["BlockRemoved", block_hashes, medium]
    ["AllBlocksCleared"]

Block hashes are ``contract/block_hash.py``'s (signed 64-bit integers), ``medium`` is "GPU" or "CPU"
(where the KV cache lives), ``lora_id`` and ``lora_name`` are nil (no adapters). As vLLM does with
data-parallel ranks, worker N of ``--workers`` binds the endpoint's port + N and sends
``data_parallel_rank`` N. A worker announces ``AllBlocksCleared`` first: a restarted worker's cache
is empty whatever a subscriber saw before.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list[int]


@dataclass(slots=True)
class AllBlocksCleared:
    pass


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class KVEventLog:
    """What the block manager changed in its prefix cache since the last ``drain()``."""

    events: list[KVCacheEvent] = field(default_factory=list)

    def drain(self) -> list[KVCacheEvent]:
        events, self.events = self.events, []
        return events


def wire_event(event: KVCacheEvent, medium: str) -> list[Any]:
    match event:
        case BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=size):
            return ["BlockStored", hashes, parent, tokens, size, None, medium, None]
        case BlockRemoved(block_hashes=hashes):
            return ["BlockRemoved", hashes, medium]
        case AllBlocksCleared():
            return ["AllBlocksCleared"]


def encode_batch(events: list[KVCacheEvent], medium: str, data_parallel_rank: int, ts: float | None = None) -> bytes:
    import msgpack

    batch = [time.time() if ts is None else ts, [wire_event(e, medium) for e in events], data_parallel_rank]
    return bytes(msgpack.packb(batch))


def offset_endpoint(endpoint: str, rank: int) -> str:
    """``tcp://*:5557`` for worker 0, ``tcp://*:5558`` for worker 1 (vLLM's offset per data-parallel rank)."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint.rpartition(":")
        return f"{host}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"


class KVEventPublisher:
    """A ZMQ PUB socket sending each batch as ``topic, sequence, payload``; bound for a wildcard address
    (``tcp://*:5557``, ipc://, inproc://), connected otherwise, as vLLM's publisher does."""

    def __init__(self, endpoint: str, rank: int, topic: str, medium: str) -> None:
        import zmq

        self.endpoint = offset_endpoint(endpoint, rank)
        self.rank, self.medium = rank, medium
        self.topic = topic.encode()
        self._seq = 0
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._socket = self._ctx.socket(zmq.PUB)
        self._socket.set_hwm(100_000)
        if "*" in self.endpoint or "::" in self.endpoint or self.endpoint.startswith(("ipc://", "inproc://")):
            self._socket.bind(self.endpoint)
        else:
            self._socket.connect(self.endpoint)

    def publish(self, events: list[KVCacheEvent]) -> None:
        if not events:
            return
        payload = encode_batch(events, self.medium, self.rank)
        self._socket.send_multipart((self.topic, self._seq.to_bytes(8, "big"), payload))
        self._seq += 1

    def close(self) -> None:
        self._socket.close(linger=500)
