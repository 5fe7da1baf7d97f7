"""The measurement: a warm-up, each concurrency level and each long prompt, on tokenmill and on the peer."""

from __future__ import annotations

import argparse
import asyncio
import statistics
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import structlog

from tokenmill_bench.arguments import constraint
from tokenmill_bench.load import (
    LevelResult,
    RequestRecord,
    Target,
    TokenmillTarget,
    random_prompt_ids,
    run_in_turns,
    run_level,
    sample_engine,
)
from tokenmill_bench.machine import buffer_bytes, local_server_pids, read_bandwidth

if TYPE_CHECKING:
    from tokenmill_bench.llama_server import LlamaServer
    from tokenmill_client import AsyncClient, ModelInfo

log = structlog.get_logger("tokenmill.bench")

WARMUP_FIRST_INDEX = 19_000
# Between one long-prompt try's seed and the next's (a length's first try keeps the seed + length of one try).
LONG_PROMPT_SEED_STEP = 1_000_003


@dataclass(slots=True)
class SideRun:
    """What one side (tokenmill or the peer) measured: its first request, its levels, its long prompts."""

    first_request: RequestRecord | None = None
    single: LevelResult | None = None
    # The machine's read rate measured right after the single stream: on a shared host the rate moves by
    # minutes, and the share of it a stream achieves means something only against the rate of its moment.
    single_read_gbs: float | None = None
    single_read_by_method_gbs: dict[str, float] = field(default_factory=dict)  # each probe's figure (the best is gbs)
    levels: list[LevelResult] = field(default_factory=list)
    long_prompts: list[dict[str, Any]] = field(default_factory=list)


@dataclass(slots=True)
class Measured:
    model_info: dict[str, Any]
    sides: dict[str, SideRun]
    peer_props: dict[str, Any] | None = None


@asynccontextmanager
async def _open_peer(spec: tuple[str, str] | None) -> AsyncIterator[LlamaServer | None]:
    if spec is None:
        yield None
        return
    from tokenmill_bench.llama_server import LlamaServer

    async with LlamaServer(spec[1]) as peer:
        yield peer


def _long_prompt_row(length: int, records: list[RequestRecord]) -> dict[str, Any]:
    """One side's row for a length: the median of its tries' times to first token (each try a fresh prompt)."""
    each = [r.ttft_s * 1000.0 if r.ttft_s is not None and r.error is None else None for r in records]
    done = [t for t in each if t is not None]
    server = [r.server_ttft_ms for r in records if r.server_ttft_ms is not None and r.error is None]
    errors = [r.error for r in records if r.error is not None]
    return {
        "prompt_tokens": length,
        "ttft_ms": statistics.median(done) if done else None,
        "ttft_ms_each": each,
        "server_ttft_ms": statistics.median(server) if server else None,
        "error": errors[0] if errors else None,
    }


async def measure(address: str, args: argparse.Namespace, server_pids: Callable[[], list[int]] | None) -> Measured:
    """Warm-up, then each concurrency level and each long prompt, tokenmill first and then the peer (when
    given) with the same requests, so both see the same machine load as nearly as one run allows."""
    from tokenmill_client import AsyncClient

    # No retries: a refused request is a failure to count, not one to hide.
    async with AsyncClient(address, max_retries=0) as client, _open_peer(args.peer) as peer:
        info = await client.model_info(timeout=30.0)
        if server_pids is None:
            server_pids = _local_server_pids(address, info)
        tokenmill = TokenmillTarget(client, constraint=constraint(args))
        targets: list[Target] = [tokenmill]
        peer_props = None
        if peer is not None:
            peer_props = await peer.props()
            targets.append(peer)
        run = _Run(args, client, tokenmill, targets, info.vocab_size, server_pids)
        await run.warm_up()
        await run.levels()
        await run.long_prompts()
        info_after = await client.model_info(timeout=30.0)
    return Measured(_model_info(info, info_after), run.sides, peer_props)


def _local_server_pids(address: str, info: ModelInfo) -> Callable[[], list[int]] | None:
    # A server this run did not start: on this machine, its processes are still known, so other
    # processes' load on the cores is measured (and warned about) as for a started one.
    ranks = [r.pid for w in info.workers for r in w.ranks if r.pid]
    local = local_server_pids(address, ranks)
    if local is None:
        log.info("other_load_unmeasured", reason="the server is not a process of this machine")
        return None
    return partial(list, local)


class _Run:
    """One measurement's sides and the settings every level of it shares."""

    def __init__(
        self,
        args: argparse.Namespace,
        client: AsyncClient,
        tokenmill: TokenmillTarget,
        targets: list[Target],
        vocab_size: int,
        server_pids: Callable[[], list[int]] | None,
    ) -> None:
        self.args, self.client, self.tokenmill, self.targets = args, client, tokenmill, targets
        self.server_pids, self.vocab_size = server_pids, vocab_size
        self.sides = {target.name: SideRun() for target in targets}
        self.common: dict[str, Any] = {
            "prompt_tokens": args.prompt_tokens,
            "vocab_size": vocab_size,
            "shared_prompt": args.shared_prompt,
            "prompt_seed": args.prompt_seed,
            "timeout": args.request_timeout,
        }

    async def warm_up(self) -> None:
        if self.args.warmup <= 0:
            return
        for target in self.targets:
            log.info("warmup", side=target.name, requests=self.args.warmup)
            # Full-size requests: the first one is reported as the cold request beside the steady state.
            warm = await run_level(
                target,
                concurrency=1,
                num_requests=self.args.warmup,
                output_tokens=self.args.output_tokens,
                label="warmup",
                # Below the 20,000 first ids prompt_ids cycles through and above any run's request count, so
                # no level repeats a warm-up prompt (900,000 did: 0 modulo 20,000 gave request 0's prompt).
                first_index=WARMUP_FIRST_INDEX,
                **self.common,
            )
            self.sides[target.name].first_request = warm.records[0]
            if warm.failed:
                log.warning("warmup_failed", side=target.name, errors=warm.errors())

    def level_of(self, target: Target, concurrency: int, requests: int, first: int) -> Awaitable[LevelResult]:
        is_tokenmill = target is self.tokenmill
        server_pids = self.server_pids
        return run_level(
            target,
            concurrency=concurrency,
            num_requests=requests,
            output_tokens=self.args.output_tokens,
            label=f"c{concurrency}",
            first_index=first,
            ramp_s=self.args.ramp_s if concurrency > 1 else 0.0,
            monitor=partial(sample_engine, self.client, period=1.0, server_pids=server_pids) if is_tokenmill else None,
            server_pids=server_pids if is_tokenmill else None,
            **self.common,
        )

    async def levels(self) -> None:
        args, targets = self.args, self.targets
        first_index = 0
        for concurrency in sorted(set(args.concurrency) | {1}):
            n = max(concurrency * args.rounds, args.min_requests)
            levels: dict[str, LevelResult] = {}
            if concurrency == 1 and len(targets) > 1:  # a request a side in turn (run_in_turns says why)
                log.info("level_start", side="each in turn", concurrency=1, requests=n)
                levels = await run_in_turns(targets, n, first_index, lambda target, i: self.level_of(target, 1, 1, i))
            for target in targets:
                if target.name not in levels:
                    log.info("level_start", side=target.name, concurrency=concurrency, requests=n)
                    levels[target.name] = await self.level_of(target, concurrency, n, first_index)
                await self._record(target, concurrency, levels[target.name])
            first_index += n

    async def _record(self, target: Target, concurrency: int, level: LevelResult) -> None:
        log.info(
            "level_done",
            side=target.name,
            concurrency=concurrency,
            tok_s=round(level.throughput_tok_s, 1),
            wall_s=round(level.wall_s, 1),
            failed=level.failed,
            other_load_cores=None if (o := level.other_load_cores) is None else round(o, 2),
        )
        side = self.sides[target.name]
        if concurrency == 1:
            side.single = level
            read_now = await asyncio.to_thread(read_bandwidth, buffer_bytes(self.args.copy_buffer_mib))
            side.single_read_gbs = read_now["gbs"]
            side.single_read_by_method_gbs = read_now["by_method_gbs"]
            log.info(
                "read_bandwidth_beside_single",
                side=target.name,
                gbs=round(read_now["gbs"], 2),
                by_method={k: round(v, 2) for k, v in read_now["by_method_gbs"].items()},
            )
        if concurrency in self.args.concurrency:
            side.levels.append(level)

    async def long_prompts(self) -> None:
        args = self.args
        for length in args.long_prompts:
            records: dict[str, list[RequestRecord]] = {target.name: [] for target in self.targets}
            for attempt in range(args.long_prompt_tries):
                # Each try its own prompt: a repeated one would be a cached prefix on either side.
                seed = args.long_prompt_seed + length + LONG_PROMPT_SEED_STEP * attempt
                ids = random_prompt_ids(length, seed=seed, vocab_size=self.vocab_size)
                for target in self.targets:
                    log.info("long_prompt", side=target.name, prompt_tokens=length, attempt=attempt)
                    record = await target.request(
                        800_000 + 100_000 * attempt + length, ids, 1, args.request_timeout, f"long{length}.{attempt}"
                    )
                    if record.error is not None:
                        log.warning("long_prompt_failed", side=target.name, prompt_tokens=length, error=record.error)
                    records[target.name].append(record)
            for name, side_records in records.items():
                self.sides[name].long_prompts.append(_long_prompt_row(length, side_records))


def _model_info(info: ModelInfo, info_after: ModelInfo) -> dict[str, Any]:
    return {
        "name": info.name,
        "context_length": info.context_length,
        "vocab_size": info.vocab_size,
        "backend": info.backend,
        "device": info.device,
        "dtype": info.dtype,
        "quantization": info.quantization,
        "weight_bytes": info.weight_bytes,
        "num_workers": info.num_workers,
        "max_batch_size": info.limits.max_batch_size,
        "max_queue": info.limits.max_queue,
        "kv_blocks_total": info.engine.kv_blocks_total,
        "kv_block_size": info.engine.kv_block_size,
        "worker_restarts_after": sum(w.restarts for w in info_after.workers),
    }
