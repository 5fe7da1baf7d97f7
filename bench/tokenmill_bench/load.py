"""The load generator: closed-loop streams of fixed-length requests to a target, timed on arrival.

A target is tokenmill over gRPC (``TokenmillTarget``) or a peer server (``llama_server.LlamaServer``);
both record a request the same way, so their levels compare directly. Every request sends the same number of prompt token ids and asks for exactly ``output_tokens`` new
tokens with ``ignore_eos``, so throughput is comparable between levels and runs. Times are taken
with ``time.perf_counter`` when each streamed message arrives; a message may carry several tokens,
whose inter-token latency is the gap since the previous token-bearing message divided between them.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc

from tokenmill_bench.machine import busy_cpu_seconds, process_cpu_seconds, rss_bytes
from tokenmill_bench.stats import summarize_ms
from tokenmill_client import AsyncClient, TokenmillError

# Ordinary vocabulary ids: skip the low ids, where Llama-family vocabularies keep their special tokens.
_FIRST_ORDINARY_ID = 1000
_ID_SPAN = 20000
# Primes, so consecutive positions (and request indices) land on unrelated ids.
_STEP = 7919
_REQUEST_STEP = 104729


def prompt_ids(length: int, index: int, vocab_size: int, *, shared: bool = False, seed: int = 0) -> list[int]:
    """A deterministic prompt of ``length`` token ids for request ``index`` of a run with ``seed``.

    Unless ``shared``, the first id depends on the request index: the server's prefix cache hashes
    blocks from the start, so a different first token makes every request pay its full prefill,
    as distinct users' prompts would. The rest of the sequence is the same for every request of the run.
    The seed (a run's ``--prompt-seed``) shifts every id, so that another run's prompts share no prefix
    with these: a server kept from an earlier run (a llama-server whose slots cache their prompts, a
    tokenmill server given by ``--server``) answers them from no cache.
    """
    lo = min(_FIRST_ORDINARY_ID, vocab_size // 4)
    span = max(1, min(_ID_SPAN, vocab_size - lo))
    ids = [lo + (i * _STEP + 13 + seed) % span for i in range(length)]
    if not shared and ids:
        ids[0] = lo + (index * _REQUEST_STEP + 7 + seed) % span
    return ids


def random_prompt_ids(length: int, seed: int, vocab_size: int) -> list[int]:
    """``length`` token ids drawn uniformly from the ordinary vocabulary, reproducibly from ``seed``: a long
    prompt no cache has seen, whose attention pattern is as dense as any real one."""
    lo = min(_FIRST_ORDINARY_ID, vocab_size // 4)
    rng = random.Random(seed)
    return [rng.randrange(lo, vocab_size) for _ in range(length)]


@dataclass(slots=True)
class RequestRecord:
    """One request's client-side timeline (perf_counter seconds) and outcome."""

    index: int
    sent: float
    arrivals: list[float] = field(default_factory=list)
    """Arrival time of each message that carried tokens."""
    counts: list[int] = field(default_factory=list)
    """Tokens in each of those messages."""
    done: float | None = None
    finish_reason: str | None = None
    server_ttft_ms: float | None = None
    server_queue_ms: float | None = None
    error: str | None = None

    @property
    def completion_tokens(self) -> int:
        return sum(self.counts)

    @property
    def ttft_s(self) -> float | None:
        return self.arrivals[0] - self.sent if self.arrivals else None

    def inter_token_s(self) -> list[float]:
        """One latency per token after the first message: each gap split evenly over its message's tokens."""
        gaps: list[float] = []
        for i in range(1, len(self.arrivals)):
            n = self.counts[i]
            gaps.extend([(self.arrivals[i] - self.arrivals[i - 1]) / n] * n)
        return gaps

    def decode_span(self) -> tuple[int, float]:
        """(tokens after the first message, seconds from the first to the last token-bearing message)."""
        if len(self.arrivals) < 2:
            return 0, 0.0
        return self.completion_tokens - self.counts[0], self.arrivals[-1] - self.arrivals[0]


async def run_request(
    client: AsyncClient,
    index: int,
    token_ids: list[int],
    output_tokens: int,
    timeout: float | None,
    label: str,
    constraint: Mapping[str, str] | None = None,
    adapter: str = "",
) -> RequestRecord:
    """Sends one request and records its timeline; failures are recorded, never raised. ``adapter``: the
    LoRA adapter it runs with, by the name the server serves it as ("": the base model).

    ``constraint``: {"json_schema": TEXT} or {"regex": TEXT}, on every request; such a request may end early
    (its grammar complete: EOS whatever ignore_eos says), which is then not counted as short."""
    record = RequestRecord(index=index, sent=time.perf_counter())
    try:
        stream = client.generate(
            token_ids=token_ids,
            max_new_tokens=output_tokens,
            ignore_eos=True,
            timeout=timeout,
            request_id=f"bench-{label}-{index}",
            json_schema=(constraint or {}).get("json_schema"),
            regex=(constraint or {}).get("regex"),
            adapter=adapter,
        )
        async with contextlib.aclosing(stream):
            async for event in stream:
                now = time.perf_counter()
                if event.tokens:
                    record.arrivals.append(now)
                    record.counts.append(len(event.tokens))
                if event.finish_reason is not None:
                    record.finish_reason = event.finish_reason.value
                if event.timing is not None:
                    record.server_ttft_ms = event.timing.time_to_first_token_ms
                    record.server_queue_ms = event.timing.queue_ms
        record.done = time.perf_counter()
    except TokenmillError as exc:
        code = exc.code.name if exc.code is not None else "UNKNOWN"
        record.error = f"{code}: {exc.message}"
    except grpc.RpcError as exc:  # the client wraps these, but a benchmark must count, not die
        record.error = f"{type(exc).__name__}: {exc}"
    ended = constraint and record.finish_reason == "eos"
    if record.error is None and record.completion_tokens != output_tokens and not ended:
        record.error = (
            f"SHORT: {record.completion_tokens} of {output_tokens} tokens (finish_reason={record.finish_reason})"
        )
    return record


class Target(Protocol):
    """A server the load generator can stream requests to: tokenmill or a peer."""

    name: str

    async def request(
        self, index: int, token_ids: list[int], output_tokens: int, timeout: float | None, label: str
    ) -> RequestRecord:
        """Sends one request for exactly ``output_tokens`` tokens; failures are recorded, never raised."""
        ...


@dataclass(slots=True)
class TokenmillTarget:
    """tokenmill through its gRPC client."""

    client: AsyncClient
    name: str = "tokenmill"
    # Every request's output constraint ({"json_schema": TEXT} or {"regex": TEXT}); None = free text.
    constraint: Mapping[str, str] | None = None

    async def request(
        self, index: int, token_ids: list[int], output_tokens: int, timeout: float | None, label: str
    ) -> RequestRecord:
        return await run_request(self.client, index, token_ids, output_tokens, timeout, label, self.constraint)


@dataclass(slots=True)
class EngineSample:
    at: float
    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    rss_bytes: int | None
    # Speculative drafts checked and kept since the workers started (cumulative).
    drafts_proposed: int = 0
    drafts_accepted: int = 0


@dataclass(slots=True)
class LevelResult:
    """One concurrency level: every request's record and the level's wall time."""

    concurrency: int
    output_tokens: int
    records: list[RequestRecord]
    wall_s: float
    engine_samples: list[EngineSample] = field(default_factory=list)
    cpu: dict[str, float | None] = field(default_factory=dict)
    """CPU seconds spent during the level by this process, the server (when its pids are known), the whole
    machine, and everything else: on a shared machine, other load explains slow levels."""

    @property
    def ok(self) -> list[RequestRecord]:
        return [r for r in self.records if r.error is None]

    @property
    def failed(self) -> int:
        return len(self.records) - len(self.ok)

    @property
    def generated_tokens(self) -> int:
        # Tokens of failed requests still cost the server work, but only finished ones count as output.
        return sum(r.completion_tokens for r in self.ok)

    @property
    def other_load_cores(self) -> float | None:
        """Cores kept busy by processes other than the server and this benchmark, on average."""
        other = self.cpu.get("other")
        return other / self.wall_s if other is not None and self.wall_s > 0 else None

    @property
    def throughput_tok_s(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def decode_tok_s(self) -> float:
        """Per-stream decode rate: tokens after the first over the time between first and last token, pooled."""
        tokens, seconds = 0, 0.0
        for r in self.ok:
            n, s = r.decode_span()
            tokens, seconds = tokens + n, seconds + s
        return tokens / seconds if seconds > 0 else 0.0

    def ttft_s(self) -> list[float]:
        return [t for r in self.ok if (t := r.ttft_s) is not None]

    def inter_token_s(self) -> list[float]:
        return [gap for r in self.ok for gap in r.inter_token_s()]

    def errors(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for r in self.records:
            if r.error is not None:
                counts[r.error] = counts.get(r.error, 0) + 1
        return counts

    def summary(self) -> dict[str, Any]:
        server_ttft = [r.server_ttft_ms / 1000.0 for r in self.ok if r.server_ttft_ms is not None]
        server_queue = [r.server_queue_ms / 1000.0 for r in self.ok if r.server_queue_ms is not None]
        messages = sum(len(r.counts) for r in self.ok)
        samples = self.engine_samples
        proposed = samples[-1].drafts_proposed - samples[0].drafts_proposed if samples else 0
        accepted = samples[-1].drafts_accepted - samples[0].drafts_accepted if samples else 0
        return {
            "concurrency": self.concurrency,
            "requests": len(self.records),
            "completed": len(self.ok),
            "failed_requests": self.failed,
            "errors": self.errors(),
            "generated_tokens": self.generated_tokens,
            "wall_s": self.wall_s,
            "throughput_tok_s": self.throughput_tok_s,
            "per_stream_decode_tok_s": self.decode_tok_s(),
            "ttft_ms": summarize_ms(self.ttft_s()),
            "itl_ms": summarize_ms(self.inter_token_s()),
            "server_ttft_ms": summarize_ms(server_ttft),
            "server_queue_ms": summarize_ms(server_queue),
            "tokens_per_message": self.generated_tokens / messages if messages else None,
            "engine_max_running": max((s.running for s in samples), default=None),
            "engine_max_waiting": max((s.waiting for s in samples), default=None),
            "engine_max_kv_blocks_used": max((s.kv_blocks_used for s in samples), default=None),
            "engine_kv_blocks_total": samples[-1].kv_blocks_total if samples else None,
            # Speculation during the level (between the first and last engine sample).
            "draft_tokens_proposed": proposed,
            "draft_tokens_accepted": accepted,
            "draft_acceptance": accepted / proposed if proposed else None,
            "server_rss_max_bytes": max((s.rss_bytes for s in samples if s.rss_bytes is not None), default=None),
            "cpu_s": self.cpu,
            "other_load_cores": self.other_load_cores,
            "per_request": [request_row(r) for r in self.records],
        }


async def run_in_turns(
    targets: Sequence[Target], requests: int, first_index: int, run: Callable[[Target, int], Awaitable[LevelResult]]
) -> dict[str, LevelResult]:
    """``requests`` rounds of one request a side in turn (``run(target, index)``: a level of that one
    request), each side's runs merged into its level, by side name. For one stream: a shared machine's read
    rate can move within seconds, and one stream reads as fast as the machine lets it, so each side's level
    taken whole a few seconds apart can see two different machines."""
    parts: dict[str, list[LevelResult]] = {target.name: [] for target in targets}
    for i in range(requests):
        for target in targets:
            parts[target.name].append(await run(target, first_index + i))
    return {name: merge_levels(runs) for name, runs in parts.items()}


def merge_levels(parts: Sequence[LevelResult]) -> LevelResult:
    """Runs of one level on one side, taken in turns with the other side's, as one level: their records
    (by index), their wall times and CPU seconds added up, their engine samples in order (the server's
    counters only grow, so first and last still span them all)."""
    if not parts:
        raise ValueError("no runs to merge")
    cpu: dict[str, float | None] = {}
    for part in parts:
        for key, seconds in part.cpu.items():
            before = cpu.get(key, 0.0)
            cpu[key] = None if seconds is None or before is None else before + seconds
    return LevelResult(
        concurrency=parts[0].concurrency,
        output_tokens=parts[0].output_tokens,
        records=sorted((r for part in parts for r in part.records), key=lambda r: r.index),
        wall_s=sum(part.wall_s for part in parts),
        engine_samples=[s for part in parts for s in part.engine_samples],
        cpu=cpu,
    )


def request_row(r: RequestRecord) -> dict[str, Any]:
    """One request, compactly: enough to find a slow or failed one in the server's log by its id."""
    ttft = r.ttft_s
    return {
        "index": r.index,
        "ttft_ms": round(ttft * 1000.0, 2) if ttft is not None else None,
        "total_ms": round((r.done - r.sent) * 1000.0, 2) if r.done is not None else None,
        "tokens": r.completion_tokens,
        "messages": len(r.counts),
        "itl_max_ms": round(max(r.inter_token_s(), default=0.0) * 1000.0, 2),
        "server_ttft_ms": round(r.server_ttft_ms, 2) if r.server_ttft_ms is not None else None,
        "server_queue_ms": round(r.server_queue_ms, 2) if r.server_queue_ms is not None else None,
        "error": r.error,
    }


async def sample_engine(
    client: AsyncClient, into: list[EngineSample], *, period: float, server_pids: Callable[[], list[int]] | None
) -> None:
    """Polls GetModelInfo (cached worker stats: cheap for the server) to see batch and queue depth,
    and the server's resident memory when its processes are known."""
    while True:
        try:
            info = await client.model_info(timeout=2.0)
        except TokenmillError:
            pass  # a missed sample is not a failed request
        else:
            e = info.engine
            rss = rss_bytes(server_pids()) if server_pids is not None else None
            into.append(
                EngineSample(
                    time.perf_counter(),
                    e.running,
                    e.waiting,
                    e.kv_blocks_used,
                    e.kv_blocks_total,
                    rss,
                    e.draft_tokens_proposed,
                    e.draft_tokens_accepted,
                )
            )
        await asyncio.sleep(period)


def _cpu_snapshot(server_pids: Callable[[], list[int]] | None) -> dict[str, float | None]:
    return {
        "client": time.process_time(),  # every thread of this process, gRPC's included
        "server": process_cpu_seconds(server_pids()) if server_pids is not None else None,
        "machine": busy_cpu_seconds(),
    }


def _cpu_spent(before: dict[str, float | None], after: dict[str, float | None]) -> dict[str, float | None]:
    spent: dict[str, float | None] = {}
    for key, start in before.items():
        end = after[key]
        spent[key] = end - start if start is not None and end is not None else None
    client, server, machine = spent["client"], spent["server"], spent["machine"]
    spent["other"] = None
    if client is not None and server is not None and machine is not None:
        spent["other"] = max(0.0, machine - server - client)
    return spent


Monitor = Callable[[list[EngineSample]], Coroutine[Any, Any, None]]
"""Runs beside a level until cancelled, appending samples of the server's state (``sample_engine``)."""


async def run_level(
    target: Target,
    *,
    concurrency: int,
    num_requests: int,
    prompt_tokens: int,
    output_tokens: int,
    vocab_size: int,
    shared_prompt: bool,
    timeout: float | None,
    label: str,
    first_index: int = 0,
    monitor: Monitor | None = None,
    server_pids: Callable[[], list[int]] | None = None,
    ramp_s: float = 0.0,
    prompt_seed: int = 0,
) -> LevelResult:
    """Runs ``num_requests`` requests, ``concurrency`` at a time (closed loop: each stream sends its next
    request as soon as its previous one ends), and times the whole level from first send to last end.

    With ``ramp_s`` = 0 every stream starts at once (a burst), and since all requests have the same
    length the streams stay in step: every round arrives together. A ramp starts stream k after
    k x ramp_s / concurrency seconds, so arrivals stay spread out, as in a steady state.
    """
    records: list[RequestRecord] = []
    indices = iter(range(first_index, first_index + num_requests))

    async def stream(k: int) -> None:
        if ramp_s > 0:
            await asyncio.sleep(k * ramp_s / concurrency)
        # The shared iterator hands each index out once: next() runs between awaits, so no lock is needed.
        for index in indices:
            ids = prompt_ids(prompt_tokens, index, vocab_size, shared=shared_prompt, seed=prompt_seed)
            records.append(await target.request(index, ids, output_tokens, timeout, label))

    samples: list[EngineSample] = []
    sampler = asyncio.create_task(monitor(samples)) if monitor is not None else None
    cpu_before = _cpu_snapshot(server_pids)
    start = time.perf_counter()
    try:
        await asyncio.gather(*(stream(k) for k in range(concurrency)))
    finally:
        wall = time.perf_counter() - start
        cpu = _cpu_spent(cpu_before, _cpu_snapshot(server_pids))
        if sampler is not None:
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler
    records.sort(key=lambda r: r.index)
    return LevelResult(concurrency, output_tokens, records, wall, samples, cpu)
