"""A long run at moderate concurrency against a tokenmill server, watching for leaks and failures:

    python bench/soak.py                                   # one hour, 8 clients, a server it starts (2 workers)
    python bench/soak.py --minutes 10 --concurrency 4      # shorter
    python bench/soak.py --json bench/results/soak.json    # the samples and the summary kept

The clients send what a service sees over time: chats that share a system prompt, plain prompts, sampled and
greedy, JSON-schema answers, streams over gRPC and over the OpenAI HTTP API, some cancelled part way (a client
that goes away), each with its own length. Every --sample seconds the resident memory of the server process and of
each worker process is read, with the KV pool's use from /metrics. Once --warmup has passed (by then the pool and
the prefix cache have filled and every code path has run), each process's growth is the slope of a straight line
through its samples, as a share of its size an hour. The script exits 1 when any request failed (a status other
than the cancellations it made itself) or any process grew by more than --max-growth a hour.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
import urllib.request
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import grpc.aio
import psutil

from tokenmill_bench.server import ManagedServer
from tokenmill_client._proto import generate_pb2 as pb
from tokenmill_client._proto import generate_pb2_grpc as pb_grpc

SYSTEM = (
    "You are a helpful assistant for a travel company. Answer briefly and politely, in plain English. "
    "If you do not know an answer, say so. Never invent prices or dates."
)
QUESTIONS = [
    "What is the capital of France?",
    "Suggest a weekend trip from Rome.",
    "How do I pack for a week in the mountains?",
    "What is a good time of year to visit Lisbon?",
    "Name three museums in London.",
    "Is it cold in Oslo in March?",
    "Write a haiku about a train.",
    "What should I see in Kyoto?",
]
PROMPTS = ["Once upon a time", "The three primary colors are", "def fibonacci(n):", "A list of fruits:"]
CITY = json.dumps(
    {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 24}, "days": {"type": "integer", "minimum": 1}},
        "required": ["city", "days"],
        "additionalProperties": False,
    }
)


@dataclass
class Sample:
    at_s: float
    rss_mib: dict[str, float]
    kv_blocks_used: float | None
    requests_ok: int
    requests_failed: int


@dataclass
class Tally:
    ok: int = 0
    cancelled: int = 0
    failed: Counter[str] = field(default_factory=Counter)
    tokens: int = 0


def grpc_request(rng: random.Random, i: int) -> pb.GenerateRequest:
    stopping = pb.StoppingParams(max_new_tokens=rng.choice([8, 16, 32, 64, 128]))
    sampling = pb.SamplingParams(temperature=rng.choice([0.0, 0.7, 1.0]), top_p=rng.choice([1.0, 0.9]), seed=i)
    kind = rng.random()
    if kind < 0.6:
        chat = pb.Messages(
            messages=[
                pb.ChatMessage(role="system", content=SYSTEM),
                pb.ChatMessage(role="user", content=f"{rng.choice(QUESTIONS)} (request {i})"),
            ]
        )
        return pb.GenerateRequest(chat=chat, stopping=stopping, sampling=sampling, top_logprobs=rng.choice([0, 2]))
    if kind < 0.8:
        return pb.GenerateRequest(prompt=rng.choice(PROMPTS), stopping=stopping, sampling=sampling)
    chat = pb.Messages(messages=[pb.ChatMessage(role="user", content="Pick a city for a short trip, as JSON.")])
    return pb.GenerateRequest(chat=chat, stopping=stopping, sampling=sampling, json_schema=CITY)


async def grpc_client(address: str, rng: random.Random, until: float, tally: Tally, first: int) -> None:
    i = first
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationStub(channel)  # type: ignore[no-untyped-call]  # (generated code)
        while time.monotonic() < until:
            i += 1
            cancel_after = rng.choice([None, None, None, None, 2])  # one stream in five goes away after 2 messages
            call = stub.Generate(grpc_request(rng, i), timeout=600)
            seen = 0
            try:
                async for message in call:
                    tally.tokens += len(message.tokens)
                    seen += 1
                    if cancel_after is not None and seen >= cancel_after:
                        call.cancel()
                        break
                if cancel_after is not None and seen >= cancel_after:
                    tally.cancelled += 1
                else:
                    tally.ok += 1
            except grpc.aio.AioRpcError as err:
                if err.code() == grpc.StatusCode.CANCELLED and cancel_after is not None:
                    tally.cancelled += 1
                else:
                    tally.failed[f"grpc {err.code().name}: {err.details()}"] += 1


async def http_client(url: str, rng: random.Random, until: float, tally: Tally, first: int) -> None:
    i = first
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        while time.monotonic() < until:
            i += 1
            body = {
                "model": "tokenmill",
                "messages": [
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"{rng.choice(QUESTIONS)} (request {i})"},
                ],
                "max_tokens": rng.choice([8, 16, 32, 64]),
                "temperature": rng.choice([0.0, 0.8]),
                "seed": i,
                "stream": rng.random() < 0.5,
            }
            try:
                async with session.post(url + "/v1/chat/completions", json=body) as reply:
                    text = await reply.text()
                    if reply.status != 200 or '"error"' in text[:200]:
                        tally.failed[f"http {reply.status}: {text[:200]}"] += 1
                    else:
                        tally.ok += 1
            except (aiohttp.ClientError, TimeoutError) as err:
                tally.failed[f"http {type(err).__name__}: {err}"] += 1


def resident_mib(server_pid: int) -> dict[str, float]:
    """The server process's resident memory and each worker's (its child processes), in MiB."""
    root = psutil.Process(server_pid)
    out = {"server": root.memory_info().rss / 2**20}
    for n, child in enumerate(sorted(root.children(recursive=True), key=lambda p: p.pid)):
        try:
            command = " ".join(child.cmdline())
            # (Workers are multiprocessing's spawned children; its resource tracker is another child.)
            name = (
                "resource-tracker"
                if "resource_tracker" in command
                else "worker"
                if "spawn" in command
                else child.name()
            )
            out[f"{name}-{n} (pid {child.pid})"] = child.memory_info().rss / 2**20
        except psutil.NoSuchProcess:
            pass
    return out


def kv_blocks_used(metrics_url: str | None) -> float | None:
    if metrics_url is None:
        return None
    try:
        with urllib.request.urlopen(metrics_url, timeout=5) as reply:
            text = reply.read().decode()
    except OSError:
        return None
    values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith("tokenmill_kv_blocks_used")]
    return sum(values) if values else None


def growth_per_hour(samples: list[Sample], name: str, after_s: float) -> float | None:
    """The least-squares slope of ``name``'s resident memory after ``after_s``, as a share of its mean an hour."""
    points = [(s.at_s, s.rss_mib[name]) for s in samples if s.at_s >= after_s and name in s.rss_mib]
    if len(points) < 3:
        return None
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_m = sum(m for _, m in points) / n
    var = sum((t - mean_t) ** 2 for t, _ in points)
    slope = sum((t - mean_t) * (m - mean_m) for t, m in points) / var  # MiB a second
    return slope * 3600 / mean_m


async def soak(args: argparse.Namespace, address: str, http_url: str | None, server_pid: int) -> dict[str, Any]:
    rng = random.Random(args.seed)
    began = time.monotonic()
    until = began + args.minutes * 60
    tally = Tally()
    clients = []
    for c in range(args.concurrency):
        crng = random.Random(rng.random())
        if http_url is not None and c % 4 == 3:  # a quarter of the clients over HTTP
            clients.append(http_client(http_url, crng, until, tally, c * 1_000_000))
        else:
            clients.append(grpc_client(address, crng, until, tally, c * 1_000_000))
    samples: list[Sample] = []

    async def sampler() -> None:
        metrics_url = f"{http_url}/metrics" if http_url is not None else None
        while True:
            at = time.monotonic() - began
            sample = Sample(
                round(at, 1),
                resident_mib(server_pid),
                kv_blocks_used(metrics_url),
                tally.ok,
                sum(tally.failed.values()),
            )
            samples.append(sample)
            line = "  ".join(f"{name.split(' ')[0]} {mib:7.1f}" for name, mib in sample.rss_mib.items())
            print(f"{at / 60:6.1f} min  ok {tally.ok:6d}  failed {sample.requests_failed:3d}  kv {sample.kv_blocks_used}  "
                  f"MiB: {line}", flush=True)  # fmt: skip
            if at >= args.minutes * 60:
                return
            await asyncio.sleep(min(args.sample, max(0.0, args.minutes * 60 - at)))

    await asyncio.gather(sampler(), *clients)
    warmup = min(args.warmup * 60, args.minutes * 60 / 2)
    names = sorted({name for s in samples for name in s.rss_mib})
    growth = {name: growth_per_hour(samples, name, warmup) for name in names}
    return {
        "minutes": args.minutes,
        "concurrency": args.concurrency,
        "warmup_minutes": warmup / 60,
        "requests_ok": tally.ok,
        "requests_cancelled": tally.cancelled,
        "requests_failed": dict(tally.failed),
        "tokens": tally.tokens,
        "growth_per_hour": growth,
        "first_after_warmup_mib": next((s.rss_mib for s in samples if s.at_s >= warmup), {}),
        "last_mib": samples[-1].rss_mib,
        "samples": [asdict(s) for s in samples],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--warmup", type=float, default=10.0, help="minutes before growth is measured")
    parser.add_argument("--sample", type=float, default=30.0, help="seconds between memory samples")
    parser.add_argument("--max-growth", type=float, default=0.01, help="the largest growth a hour allowed, a share")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--server-args", default="--workers 2", help="the started server's flags")
    args = parser.parse_args()

    server = ManagedServer(args.server_args.split()).start()
    try:
        assert server.proc is not None and server.http_port is not None
        http_url = f"http://127.0.0.1:{server.http_port}"
        result = asyncio.run(soak(args, server.address, http_url, server.proc.pid))
        restarts = [
            line for line in server.tail(-1).splitlines() if '"worker_died"' in line or '"worker_killed"' in line
        ]
    finally:
        server.stop()
    result["worker_restarts"] = len(restarts)
    result["server_args"] = args.server_args
    print()
    print(f"requests: {result['requests_ok']} answered, {result['requests_cancelled']} cancelled by the client, "
          f"{sum(result['requests_failed'].values())} failed; {result['tokens']} tokens; "
          f"{result['worker_restarts']} worker restarts")  # fmt: skip
    for message, count in result["requests_failed"].items():
        print(f"  failed x{count}: {message}")
    print(f"resident memory after the {result['warmup_minutes']:.0f}-minute warm-up, and its growth an hour:")
    bad = bool(result["requests_failed"]) or result["worker_restarts"] > 0
    for name, growth in result["growth_per_hour"].items():
        first = result["first_after_warmup_mib"].get(name)
        last = result["last_mib"].get(name)
        shown = "n/a" if growth is None else f"{100 * growth:+.2f} %"
        print(f"  {name:28s} {first or 0:8.1f} -> {last or 0:8.1f} MiB   {shown} an hour")
        bad |= growth is not None and growth > args.max_growth
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
