"""The llama.cpp peer: a running ``llama-server`` driven through its ``/completion`` streaming endpoint.

Each request sends the same token ids tokenmill gets as ``prompt`` and asks for exactly
``n_predict`` tokens with ``ignore_eos`` and greedy sampling, streamed as server-sent events
(``data: {json}`` lines, one blank line after each). llama-server sends one event per generated
token, except that a token ending in an incomplete UTF-8 sequence is held back and its event
merged into the next one; every event carries ``tokens_predicted`` (tokens generated so far), so
a message's token count is the difference from the previous one, never a count of events. The
last event has ``"stop": true`` and the server's ``timings``; an error arrives as
``data: {"error": {...}}`` or, before the stream starts, as a non-200 response.
"""

from __future__ import annotations

import asyncio
import json
import time
from types import TracebackType
from typing import TYPE_CHECKING, Any

import aiohttp

from tokenmill_bench.load import RequestRecord

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self needs Python 3.11

NAME = "llama-server"
# The final event repeats the whole prompt as text and the generation settings: tens of kB for long prompts.
_READ_BUFFER_BYTES = 2**20
# What talking to an unreachable or misbehaving peer raises (ValueError: a body that is not JSON).
PEER_ERRORS: tuple[type[BaseException], ...] = (aiohttp.ClientError, asyncio.TimeoutError, TypeError, ValueError)


def completion_body(token_ids: list[int], output_tokens: int, *, cache_prompt: bool = True) -> dict[str, Any]:
    """The ``/completion`` request matching tokenmill's bench request: token-id prompt, exactly
    ``output_tokens`` greedy tokens (``top_k`` 1 and temperature 0), end-of-sequence ignored.

    ``cache_prompt`` lets the slot keep a prompt's common prefix, as tokenmill's prefix cache does; the
    bench's prompts differ in their first token, so neither server can skip any prefill.
    """
    return {
        "prompt": token_ids,
        "n_predict": output_tokens,
        "stream": True,
        "ignore_eos": True,
        "cache_prompt": cache_prompt,
        "temperature": 0.0,
        "top_k": 1,
    }


def record_event(record: RequestRecord, event: dict[str, Any], now: float) -> bool:
    """Folds one streamed event into ``record``; returns True when it was the last one (or an error)."""
    if "error" in event:
        error = event["error"]
        message = error.get("message", error) if isinstance(error, dict) else error
        record.error = f"SERVER: {message}"
        return True
    predicted = event.get("tokens_predicted")
    if isinstance(predicted, int):
        new = predicted - record.completion_tokens
    else:  # an older server without the counter: one token per event that carries any
        new = len(event.get("tokens") or []) or (1 if event.get("content") else 0)
    if new > 0:
        record.arrivals.append(now)
        record.counts.append(new)
    if not event.get("stop"):
        return False
    record.finish_reason = str(event.get("stop_type") or "stop")
    timings = event.get("timings") or {}
    prompt_ms = timings.get("prompt_ms")
    if isinstance(prompt_ms, int | float):
        record.server_ttft_ms = float(prompt_ms)
    return True


class LlamaServer:
    """A running llama-server at ``url`` (e.g. ``http://127.0.0.1:8080``); use as ``async with``."""

    name = NAME

    def __init__(self, url: str, *, cache_prompt: bool = True) -> None:
        self.url = url.rstrip("/")
        self.cache_prompt = cache_prompt
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Self:
        # No connection limit: 64 streams need 64 connections at once (aiohttp's default pool holds 100).
        # A connection per request: llama-server drops idle keep-alive connections after 5 s (and any
        # after 5 requests), so a pooled one reused after tokenmill's turn at a level fails mid-write
        # ("Can not write request body"), which once failed 60 of 163 peer requests in a run.
        connector = aiohttp.TCPConnector(limit=0, force_close=True)
        self._session = aiohttp.ClientSession(connector=connector, read_bufsize=_READ_BUFFER_BYTES)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("LlamaServer is used outside 'async with'")
        return self._session

    async def props(self, timeout: float = 10.0) -> dict[str, Any]:
        """``GET /props``: the server's model path, context size, slots and build."""
        async with self.session.get(f"{self.url}/props", timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            resp.raise_for_status()
            body = await resp.json()
        if not isinstance(body, dict):
            raise TypeError(f"{self.url}/props did not answer a JSON object")
        return body

    async def request(
        self, index: int, token_ids: list[int], output_tokens: int, timeout: float | None, label: str
    ) -> RequestRecord:
        """Streams one completion and records its timeline; failures are recorded, never raised."""
        record = RequestRecord(index=index, sent=time.perf_counter())
        body = completion_body(token_ids, output_tokens, cache_prompt=self.cache_prompt)
        try:
            async with self.session.post(
                f"{self.url}/completion", json=body, timeout=aiohttp.ClientTimeout(total=timeout)
            ) as resp:
                if resp.status != 200:
                    record.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                    return record
                async for raw in resp.content:
                    now = time.perf_counter()
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue  # the blank line ending an event, or a comment (keep-alive)
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        break
                    if record_event(record, json.loads(payload), now):
                        break
            record.done = time.perf_counter()
        except PEER_ERRORS as exc:
            record.error = f"{type(exc).__name__}: {exc}"
        if record.error is None and record.finish_reason is None:
            record.error = "CLOSED: the stream ended without a final event"
        if record.error is None and record.completion_tokens != output_tokens:
            record.error = (
                f"SHORT: {record.completion_tokens} of {output_tokens} tokens (stop_type={record.finish_reason})"
            )
        return record
