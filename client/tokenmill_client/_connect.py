"""Waiting, before the first call, until a channel is connected to every address its target resolves to.

gRPC's round_robin sends each call to one of the addresses it is connected to *now*: a channel is READY as
soon as its first address is, so calls made right after a client is created all go to the server that
answered first. grpc-python's public API shows only the channel's state (``channel_ready_future``,
``subscribe``), not each address's (subchannel's). gRPC's channelz (gRFC A14: the data the grpcio-channelz
service serves, which grpc-python's core keeps for every channel, on by default) does: each channel's
subchannels, one per resolved address, with their connectivity state. A new channel is found among
channelz's top channels as the one with the client's target that was not there before it was created.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
import grpc.aio

_POLL_SECONDS = 0.01


def _channelz() -> tuple[Callable[[int], bytes], Callable[[int], bytes]] | None:
    """grpc core's channelz queries (what grpcio-channelz's servicer calls), or None where missing."""
    try:
        cygrpc = importlib.import_module("grpc._cython.cygrpc")  # untyped: grpc-stubs leaves it out
    except ImportError:  # pragma: no cover - a grpcio without its core
        return None
    top = getattr(cygrpc, "channelz_get_top_channels", None)
    sub = getattr(cygrpc, "channelz_get_subchannel", None)
    return (top, sub) if callable(top) and callable(sub) else None


def _top_channels() -> list[dict[str, Any]]:
    queries = _channelz()
    if queries is None:
        return []
    get_top, _ = queries
    channels: list[dict[str, Any]] = []
    start = 0
    while True:
        page = json.loads(get_top(start))
        found = page.get("channel", [])
        channels.extend(found)
        if page.get("end", True) or not found:
            return channels
        start = max(int(c["ref"]["channelId"]) for c in found) + 1


def channel_ids(target: str) -> frozenset[int]:
    """The ids of the live channels to ``target`` (empty where channelz is not available)."""
    return frozenset(int(c["ref"]["channelId"]) for c in _top_channels() if c.get("data", {}).get("target") == target)


@dataclass(frozen=True, slots=True)
class Connections:
    """How many of the addresses a channel's target resolved to it is connected to (``Client.wait_for_addresses``)."""

    ready: int
    total: int
    observed: bool = True
    """Whether each address was observed; False with pick_first (one connection at a time) or where gRPC's
    channelz is not available: then ``ready``/``total`` is 1/1 or 0/1, the channel's own state."""

    @property
    def all_ready(self) -> bool:
        return self.total > 0 and self.ready == self.total


def address_states(channel_id_set: frozenset[int]) -> Connections:
    """The connectivity of every subchannel (one per resolved address) of the channels ``channel_id_set``."""
    queries = _channelz()
    if queries is None or not channel_id_set:
        return Connections(0, 0, observed=False)
    _, get_sub = queries
    ready = total = 0
    for channel in _top_channels():
        if int(channel["ref"]["channelId"]) not in channel_id_set:
            continue
        for ref in channel.get("subchannelRef", []):
            data = json.loads(get_sub(int(ref["subchannelId"])))
            state = data.get("subchannel", {}).get("data", {}).get("state", {}).get("state")
            total += 1
            ready += state == "READY"
    return Connections(ready, total)


class ChannelWatch:
    """Knows a new channel among channelz's channels: create it between ``ChannelWatch(target)`` and ``found()``."""

    def __init__(self, target: str) -> None:
        self.target = target
        self._before = channel_ids(target)
        self._ids: frozenset[int] = frozenset()

    def found(self) -> None:
        self._ids = channel_ids(self.target) - self._before

    def wait(self, channel: grpc.Channel, timeout: float, *, every_address: bool) -> Connections:
        """Blocks until ``channel`` is READY and, with ``every_address``, connected to every address its
        target resolved to, or ``timeout`` seconds passed; says how many addresses are connected."""
        end = time.monotonic() + timeout
        try:
            grpc.channel_ready_future(channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            return self._state(ready=False, every_address=every_address)
        while (state := self._settled(every_address, lambda: time.monotonic() >= end)) is None:
            time.sleep(_POLL_SECONDS)
        return state

    async def wait_async(self, channel: grpc.aio.Channel, timeout: float, *, every_address: bool) -> Connections:
        """``wait()`` for a grpc.aio channel."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        try:
            await asyncio.wait_for(channel.channel_ready(), timeout)
        except asyncio.TimeoutError:
            return self._state(ready=False, every_address=every_address)
        while (state := self._settled(every_address, lambda: loop.time() >= end)) is None:
            await asyncio.sleep(_POLL_SECONDS)
        return state

    def _settled(self, every_address: bool, out_of_time: Callable[[], bool]) -> Connections | None:
        """Once the channel is READY: the connections when waiting is over (no address to wait for, every
        one connected, or no time left), else None (poll again)."""
        if not (every_address and self._ids):
            return self._state(ready=True, every_address=every_address)
        state = address_states(self._ids)
        return state if state.all_ready or out_of_time() else None

    def _state(self, *, ready: bool, every_address: bool) -> Connections:
        if every_address and self._ids:
            return address_states(self._ids)
        # pick_first uses one address at a time: the channel's state is the one that counts.
        return Connections(int(ready), 1, observed=False)
