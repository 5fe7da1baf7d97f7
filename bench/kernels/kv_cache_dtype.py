"""What ``--kv-cache-dtype float16`` saves: attention and whole steps, float32 cache against float16.

    python bench/kernels/kv_cache_dtype.py --repeats 7

The default model, its native kernels, one process; the two caches take turns, so both see the same
machine load. Printed: median milliseconds of native attention for one layer (decode batches at
long contexts, a 512-token prefill chunk) and of a whole engine step (decode batches of 1, 16 and
64 sequences at 1000 tokens of context).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tokenmill_service.worker.engine.model_runner import ModelRunner, StepPlan
from tokenmill_service.worker.kernels.cpu import paged_attention
from tokenmill_service.worker.loader import load_model, resolve_model_path

BLOCK = 16
DTYPES = (torch.float32, torch.float16)


def attention(repeats: int) -> None:
    kv_heads, d, heads = 3, 64, 9
    print("attention (one layer), ms")
    for seqs, q_len, ctx in ((64, 1, 200), (64, 1, 1000), (16, 1, 2000), (1, 512, 3488)):
        nb = -(-(ctx + q_len) // BLOCK)
        k, v = torch.randn(seqs * nb, BLOCK, kv_heads, d), torch.randn(seqs * nb, BLOCK, kv_heads, d)
        caches = {dt: (k.to(dt), v.to(dt)) for dt in DTYPES}
        tables = torch.arange(seqs * nb).view(seqs, nb)
        positions = torch.arange(ctx, ctx + q_len).repeat(seqs)
        seq_of_token = torch.arange(seqs).repeat_interleave(q_len)
        q = torch.randn(seqs * q_len, heads, d)
        times: dict[torch.dtype, list[float]] = {dt: [] for dt in DTYPES}
        for _ in range(repeats):
            for dt, (kc, vc) in caches.items():
                start = time.perf_counter()
                paged_attention.paged_attention(q, kc, vc, positions, seq_of_token, tables, d**-0.5)
                times[dt].append(time.perf_counter() - start)
        f32, f16 = (statistics.median(times[dt]) * 1e3 for dt in DTYPES)
        print(f"  {seqs} x {q_len} at {ctx}: float32 {f32:.2f}, float16 {f16:.2f} ({f32 / f16:.2f}x)")


def steps(repeats: int) -> None:
    path = resolve_model_path(None)
    models = {name: load_model(path, quantization="auto", kv_cache_dtype=name) for name in ("float32", "float16")}
    print("engine step (decode), ms")
    for n, ctx in ((64, 1000), (16, 1000), (1, 1000)):
        nb = ctx // BLOCK + 2
        runners = {name: ModelRunner(m, BLOCK, n * nb) for name, m in models.items()}
        tables = [list(range(i * nb, (i + 1) * nb)) for i in range(n)]
        plan = StepPlan([5] * n, [1] * n, [ctx] * n, tables, list(range(n)), [])
        times: dict[str, list[float]] = {name: [] for name in runners}
        for _ in range(repeats + 1):
            for name, runner in runners.items():
                start = time.perf_counter()
                runner.execute(plan)
                times[name].append(time.perf_counter() - start)
        f32, f16 = (statistics.median(times[name][1:]) * 1e3 for name in runners)
        print(f"  {n} sequences at {ctx}: float32 {f32:.1f}, float16 {f16:.1f} ({f32 / f16:.2f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(2)
    with torch.inference_mode():
        attention(args.repeats)
        steps(args.repeats)


if __name__ == "__main__":
    main()
