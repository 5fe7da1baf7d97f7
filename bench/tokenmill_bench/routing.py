"""Prefix-aware routing against least-load: ``tokenmill-bench routing``.

The workload of a chat service with a few system prompts: ``--system-prompts`` (8) prompts of
``--system-tokens`` (1,500) token ids, and ``--requests`` (200) requests, each one of those system
prompts (drawn reproducibly) followed by its own ``--question-tokens`` (32) ids, asking for
``--output-tokens`` (16) greedy tokens, ``--concurrency`` (16) at a time in a closed loop. For each
``--routing`` mode a server is started with ``--workers`` (2) and that mode, warmed with one
request, and measured: TTFT p50/p90 (client side), generated tokens per second (wall time from
the first send to the last end) and the prefix cache's hit rate over the run (GetModelInfo is not
enough for that: it is read from the server's Prometheus endpoint). ``--workload distinct`` gives
every request its own first token, so nothing is shared: the control, where prefix-aware routing
must do no worse than least-load.

    tokenmill-bench routing --json bench/results/results-routing.json
    tokenmill-bench routing --workload distinct --json bench/results/results-routing-distinct.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenmill_bench.load import random_prompt_ids, run_request
from tokenmill_bench.server import ManagedServer, free_port
from tokenmill_bench.stats import summarize_ms
from tokenmill_client import AsyncClient


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tokenmill-bench routing", description=__doc__.split("\n\n")[0])
    p.add_argument("--routing", default="prefix,least-load", help="modes to compare, comma-separated")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--system-prompts", type=int, default=8)
    p.add_argument("--system-tokens", type=int, default=1500)
    p.add_argument("--question-tokens", type=int, default=32)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--workload", choices=["shared", "distinct"], default="shared", help="distinct: no prompt shares a prefix"
    )
    p.add_argument(
        "--kv-cache-memory",
        default="256MiB",
        help="each worker's KV cache pool (the server's --kv-cache-memory): the default holds about 3.5 of the "
        "system prompts per worker for the embedded SmolLM2 (46 KB a token at float32), so a worker that sees "
        "every prompt (least-load) keeps evicting them and one that sees its half (prefix) mostly does not; "
        "'' = the server's own choice",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--server-arg", action="append", default=[], help="passed to every started server (repeatable)")
    p.add_argument("--json", type=Path, help="write the results here")
    return p


def workload(args: argparse.Namespace, vocab_size: int) -> list[list[int]]:
    """Every request's token ids, the same for every mode measured."""
    rng = random.Random(args.seed)
    systems = [
        random_prompt_ids(args.system_tokens, seed=args.seed * 1000 + i, vocab_size=vocab_size)
        for i in range(args.system_prompts)
    ]
    prompts = []
    for index in range(args.requests):
        question = random_prompt_ids(args.question_tokens, seed=args.seed * 1_000_000 + index, vocab_size=vocab_size)
        system = list(systems[rng.randrange(len(systems))])
        if args.workload == "distinct":
            system[0] = random_prompt_ids(1, seed=args.seed * 7_000_000 + index, vocab_size=vocab_size)[0]
            system[1] = random_prompt_ids(1, seed=args.seed * 9_000_000 + index, vocab_size=vocab_size)[0]
        prompts.append(system + question)
    return prompts


def prefix_counters(metrics_port: int) -> dict[str, float]:
    """The prefix cache's hit rate and the tokens generated so far, from the Prometheus endpoint."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    found = {}
    for line in body.splitlines():
        for name in ("tokenmill_prefix_cache_hit_rate", "tokenmill_generated_tokens_total"):
            if line.startswith(name + " "):
                found[name] = float(line.rsplit(" ", 1)[1])
    return found


async def measure(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    metrics_port = free_port()
    extra = ["--workers", str(args.workers), "--routing", mode, "--metrics-port", str(metrics_port)]
    if args.kv_cache_memory:
        extra += ["--kv-cache-memory", args.kv_cache_memory]
    extra += args.server_arg
    with ManagedServer(extra) as server:
        async with AsyncClient(server.address, max_retries=0) as client:
            info = await client.model_info(timeout=30.0)
            prompts = workload(args, info.vocab_size)
            # One request of another prompt, so that no worker pays a lazy set-up inside the measurement.
            warm = random_prompt_ids(64, seed=-1, vocab_size=info.vocab_size)
            await run_request(client, -1, warm, 1, args.timeout, f"{mode}-warm")
            indices = iter(range(len(prompts)))
            records = []

            async def stream() -> None:
                for index in indices:
                    records.append(
                        await run_request(client, index, prompts[index], args.output_tokens, args.timeout, mode)
                    )

            start = time.perf_counter()
            await asyncio.gather(*(stream() for _ in range(args.concurrency)))
            wall = time.perf_counter() - start
        counters = prefix_counters(metrics_port)
    ok = [r for r in records if r.error is None]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    return {
        "routing": mode,
        "requests": len(records),
        "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "wall_s": round(wall, 3),
        "throughput_tok_s": round(sum(r.completion_tokens for r in ok) / wall, 2) if wall else None,
        "requests_per_s": round(len(ok) / wall, 3) if wall else None,
        "ttft_ms": summarize_ms(ttft),
        "prefix_cache_hit_rate": counters.get("tokenmill_prefix_cache_hit_rate"),
        "server_log": server.log_path,
    }


def format_table(results: list[dict[str, Any]]) -> str:
    lines = [
        f"{'routing':<12} {'TTFT p50 ms':>12} {'TTFT p90 ms':>12} {'tok/s':>8} {'req/s':>7} {'hit rate':>9} failed"
    ]
    for r in results:
        t = r["ttft_ms"]
        lines.append(
            f"{r['routing']:<12} {t['p50'] or 0:>12.0f} {t['p90'] or 0:>12.0f} {r['throughput_tok_s'] or 0:>8.1f} "
            f"{r['requests_per_s'] or 0:>7.2f} {r['prefix_cache_hit_rate'] or 0:>9.2f} {r['failed']}"
        )
    return "\n".join(lines)


def routing_main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(argv)
    modes = [m.strip() for m in args.routing.split(",") if m.strip()]
    try:
        results = [asyncio.run(measure(args, mode)) for mode in modes]
    except RuntimeError as exc:
        sys.stderr.write(f"tokenmill-bench routing: error: {exc}\n")
        return 2
    config = {k: v for k, v in vars(args).items() if k not in ("json", "server_arg")} | {"server_arg": args.server_arg}
    report = {"config": config, "results": results}
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    sys.stdout.write(format_table(results) + "\n")
    return 1 if any(r["failed"] for r in results) else 0
