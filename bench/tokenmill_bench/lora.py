"""Multi-LoRA serving against the base model alone: ``tokenmill-bench lora``.

The bench makes ``--adapters`` (8) LoRA adapters of rank ``--rank`` (16) for the served model (random A
and B on every projection, q/k/v/o and gate/up/down, saved in PEFT's format: ``adapter_config.json`` +
``adapter_model.safetensors``), starts a server with ``--max-loras`` as many slots and the adapters as
``--lora-modules``, and warms every adapter with one request (then all of them in one step). Then, at each ``--concurrency`` level (16
and 64 streams), it measures generated tokens per second twice in a closed loop of ``--rounds`` requests
per stream of ``--prompt-tokens`` random ids and ``--output-tokens`` greedy tokens: once with every
request on the base model, once with request i on adapter i mod ``--adapters``; the report gives the
ratio (the target is at least 0.7). Last, the time to load one adapter through
``POST /v1/load_lora_adapter`` (and unload it again), ``--load-trials`` (5) times: p50 and max, and the
time to first token of the one-token request that then uses it (which writes it into a slot).

    tokenmill-bench lora --json bench/results/results-lora.json
    tokenmill-bench lora --model /models/Llama-3.2-1B-Instruct --concurrency 16,64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenmill_bench.load import RequestRecord, random_prompt_ids, run_request
from tokenmill_bench.model import default_model_path
from tokenmill_bench.server import ManagedServer
from tokenmill_bench.stats import percentile
from tokenmill_client import AsyncClient

TARGETS = (
    ("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"), ("self_attn", "o_proj"),
    ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj"),
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class BaseDims:
    """What an adapter's shapes follow: the served model's dimensions."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int

    def shape(self, leaf: str) -> tuple[int, int]:
        """A projection's weight [out, in]."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        h, i = self.hidden, self.intermediate
        return {
            "q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i),
        }[leaf]  # fmt: skip


def base_dims(model: Path) -> BaseDims:
    """The dimensions of a Hugging Face directory (config.json) or a GGUF file (its metadata)."""
    if model.is_dir():
        c = json.loads((model / "config.json").read_text())
        heads = int(c["num_attention_heads"])
        return BaseDims(
            int(c["hidden_size"]), int(c["intermediate_size"]), int(c["num_hidden_layers"]), heads,
            int(c.get("num_key_value_heads") or heads), int(c.get("head_dim") or c["hidden_size"] // heads),
        )  # fmt: skip
    import gguf

    reader = gguf.GGUFReader(str(model))

    def field(key: str) -> Any:
        f = reader.fields.get(key)
        return None if f is None else f.contents()

    arch = field("general.architecture")
    hidden, heads = int(field(f"{arch}.embedding_length")), int(field(f"{arch}.attention.head_count"))
    return BaseDims(
        hidden, int(field(f"{arch}.feed_forward_length")), int(field(f"{arch}.block_count")), heads,
        int(field(f"{arch}.attention.head_count_kv") or heads), int(field(f"{arch}.attention.key_length") or hidden // heads),
    )  # fmt: skip


def write_adapter(directory: Path, dims: BaseDims, rank: int, seed: int) -> Path:
    """A PEFT LoRA adapter of ``dims`` with random A and B on every projection (what ``save_pretrained``
    writes: the config and the tensors under PEFT's names)."""
    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(dims.layers):
        for parent, leaf in TARGETS:
            out, inp = dims.shape(leaf)
            stem = f"base_model.model.model.layers.{layer}.{parent}.{leaf}"
            tensors[f"{stem}.lora_A.weight"] = (rng.standard_normal((rank, inp)) / np.sqrt(inp)).astype(np.float32)
            tensors[f"{stem}.lora_B.weight"] = (rng.standard_normal((out, rank)) * 0.01).astype(np.float32)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
        "target_modules": sorted(leaf for _, leaf in TARGETS), "bias": "none", "use_rslora": False,
    }  # fmt: skip
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return directory


def adapter_of(index: int, names: Sequence[str]) -> str:
    """The adapter request ``index`` uses: spread evenly over ``names`` ("" when none: the base)."""
    return names[index % len(names)] if names else ""


def throughput(records: Sequence[RequestRecord], wall_s: float) -> dict[str, Any]:
    """A level's accounting: tokens of the finished requests over the level's wall time."""
    ok = [r for r in records if r.error is None]
    tokens = sum(r.completion_tokens for r in ok)
    return {
        "requests": len(records),
        "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "generated_tokens": tokens,
        "wall_s": round(wall_s, 3),
        "tokens_per_s": round(tokens / wall_s, 2) if wall_s > 0 else None,
    }


def ratio(lora: dict[str, Any], base: dict[str, Any]) -> float | None:
    """Adapters' tokens/s over the base model's (None when either is missing or a request failed)."""
    if lora["failed"] or base["failed"] or not lora["tokens_per_s"] or not base["tokens_per_s"]:
        return None
    return round(float(lora["tokens_per_s"]) / float(base["tokens_per_s"]), 3)


def load_times(samples_s: Sequence[float]) -> dict[str, Any]:
    ms = [s * 1000.0 for s in samples_s]
    return {"trials": len(ms), "p50_ms": percentile(ms, 50), "max_ms": max(ms) if ms else None}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tokenmill-bench lora", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, help="the served model (default: the server's embedded one)")
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--concurrency", default="16,64", help="stream counts, comma-separated")
    p.add_argument("--rounds", type=int, default=3, help="requests per stream at each level")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--load-trials", type=int, default=5)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--adapter-dir", type=Path, help="where to write the adapters (default: a temporary directory)")
    p.add_argument("--server-arg", action="append", default=[], help="passed to the started server (repeatable)")
    p.add_argument("--json", type=Path, help="write the results here")
    return p


async def _level(
    client: AsyncClient, args: argparse.Namespace, concurrency: int, names: Sequence[str], vocab: int
) -> dict[str, Any]:
    """One closed-loop level: ``concurrency`` streams of ``args.rounds`` requests each."""
    count = concurrency * args.rounds
    indices = iter(range(count))
    records: list[RequestRecord] = []
    label = "lora" if names else "base"

    async def stream() -> None:
        for i in indices:
            prompt = random_prompt_ids(args.prompt_tokens, seed=args.seed * 1_000_000 + i, vocab_size=vocab)
            records.append(
                await run_request(
                    client,
                    i,
                    prompt,
                    args.output_tokens,
                    args.timeout,
                    f"{label}{concurrency}",
                    adapter=adapter_of(i, names),
                )
            )

    start = time.perf_counter()
    await asyncio.gather(*(stream() for _ in range(concurrency)))
    return throughput(records, time.perf_counter() - start)


def _post(url: str, body: dict[str, str]) -> None:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as reply:
        reply.read()


async def measure(args: argparse.Namespace, adapters: dict[str, Path]) -> dict[str, Any]:
    names = sorted(adapters)
    extra = ["--max-loras", str(len(names)), "--max-lora-rank", str(args.rank)]
    extra += ["--lora-modules", *(f"{n}={p}" for n, p in sorted(adapters.items()))]
    extra += (["--model", str(args.model)] if args.model else []) + args.server_arg
    levels = []
    with ManagedServer(extra) as server:
        async with AsyncClient(server.address, max_retries=0) as client:
            info = await client.model_info(timeout=30.0)
            warm = random_prompt_ids(16, seed=-1, vocab_size=info.vocab_size)
            for name in ["", *names]:  # every adapter in its slot before anything is timed
                await run_request(client, -1, warm, 2, args.timeout, "warm", adapter=name)
            # And one mixed step: every adapter and the base together.
            await asyncio.gather(
                *(run_request(client, -2, warm, 2, args.timeout, f"warm{n}", adapter=n) for n in ["", *names])
            )
            for concurrency in sorted({int(c) for c in args.concurrency.split(",") if c.strip()}):
                base = await _level(client, args, concurrency, [], info.vocab_size)
                lora = await _level(client, args, concurrency, names, info.vocab_size)
                levels.append({"concurrency": concurrency, "base": base, "lora": lora, "ratio": ratio(lora, base)})
            samples, first_use = [], []
            url = f"http://127.0.0.1:{server.http_port}/v1"
            for trial in range(args.load_trials):
                name = f"bench-load-{trial}"
                began = time.perf_counter()
                _post(f"{url}/load_lora_adapter", {"lora_name": name, "lora_path": str(adapters[names[0]])})
                samples.append(time.perf_counter() - began)
                # Its first request writes it into a slot (evicting the least recently used adapter).
                first = await run_request(client, -3, warm, 1, args.timeout, f"first{trial}", adapter=name)
                if first.error is None and first.ttft_s is not None:
                    first_use.append(first.ttft_s)
                _post(f"{url}/unload_lora_adapter", {"lora_name": name})
    load = load_times(samples) | {"first_request_ttft": load_times(first_use)}
    return {"levels": levels, "load": load, "server_log": server.log_path}


def format_table(result: dict[str, Any]) -> str:
    lines = [f"{'streams':>7} {'base tok/s':>11} {'lora tok/s':>11} {'ratio':>6} failed"]
    for level in result["levels"]:
        b, lo = level["base"], level["lora"]
        lines.append(
            f"{level['concurrency']:>7} {b['tokens_per_s'] or 0:>11.1f} {lo['tokens_per_s'] or 0:>11.1f} "
            f"{level['ratio'] or 0:>6.2f} {b['failed'] + lo['failed']}"
        )
    load = result["load"]
    if load["trials"]:
        lines.append(f"adapter load (/v1/load_lora_adapter): p50 {load['p50_ms']:.1f} ms, max {load['max_ms']:.1f} ms")
    first = load.get("first_request_ttft") or {}
    if first.get("trials"):
        lines.append(
            f"its first request's TTFT (slot write): p50 {first['p50_ms']:.1f} ms, max {first['max_ms']:.1f} ms"
        )
    return "\n".join(lines)


def lora_main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(argv)
    model = args.model or default_model_path()
    if model is None:
        sys.stderr.write("tokenmill-bench lora: error: no --model given and the embedded model is not installed\n")
        return 2
    with tempfile.TemporaryDirectory(prefix="tokenmill-bench-lora-") as tmp:
        root = args.adapter_dir or Path(tmp)
        dims = base_dims(Path(model))
        adapters = {
            f"lora{i}": write_adapter(root / f"lora{i}", dims, args.rank, args.seed + i) for i in range(args.adapters)
        }
        try:
            result = asyncio.run(measure(args, adapters))
        except RuntimeError as exc:
            sys.stderr.write(f"tokenmill-bench lora: error: {exc}\n")
            return 2
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "json"}
    report = {"config": config | {"model": str(model)}, **result}
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    sys.stdout.write(format_table(result) + "\n")
    return 1 if any(level["base"]["failed"] or level["lora"]["failed"] for level in result["levels"]) else 0
