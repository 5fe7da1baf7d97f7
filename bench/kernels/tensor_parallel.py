"""What one engine step costs with the model split over N ranks (gloo on CPU), against one rank.

    python bench/kernels/tensor_parallel.py --sizes 1 3 --repeats 20

Each size spawns its ranks; rank 0 broadcasts every step's plan and runs its shard (the path the
server takes), the others follow. Reported: the median wall time of a step on rank 0, for a
128-token prefill and for decode steps of 1 and 16 sequences, in the default configuration
(the embedded model, int4 as stored, float32 activations).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tokenmill_service.worker.distributed.parallel import TensorParallel
from tokenmill_service.worker.distributed.step_broadcast import StepBroadcast, Stop, follow
from tokenmill_service.worker.engine.model_runner import ModelRunner, StepPlan
from tokenmill_service.worker.loader import load_model, resolve_model_path

BLOCK = 16
PREFILL = 128


def plans() -> dict[str, StepPlan]:
    """Steps of fixed shapes over a pool where sequence i owns blocks [i * 16, i * 16 + 16)."""
    prefill = StepPlan(list(range(1, PREFILL + 1)), [PREFILL], [0], [list(range(16))], [PREFILL - 1], [])

    def decode(n: int) -> StepPlan:
        tables = [list(range(i * 16, i * 16 + 16)) for i in range(n)]
        return StepPlan([7] * n, [1] * n, [PREFILL] * n, tables, list(range(n)), [])

    return {"prefill 128 tokens": prefill, "decode, 1 sequence": decode(1), "decode, 16 sequences": decode(16)}


def rank_main(rank: int, size: int, port: int, threads: int, repeats: int, out: str) -> None:
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    tp = TensorParallel(rank, size)
    model = load_model(resolve_model_path(None), quantization="auto", tp=tp)
    runner = ModelRunner(model, BLOCK, 16 * 16)
    if rank:
        follow(runner, tp)
        dist.destroy_process_group()
        return
    broadcast = StepBroadcast(tp) if size > 1 else None
    results = {}
    for name, plan in plans().items():
        times = []
        for i in range(repeats + 2):
            start = time.perf_counter()
            if broadcast is not None:
                broadcast.send(plan)
            runner.execute(plan)
            if i >= 2:  # the first runs warm the caches and allocator
                times.append(time.perf_counter() - start)
        results[name] = round(statistics.median(times) * 1000, 1)
    if broadcast is not None:
        broadcast.send(Stop())
    Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: the cores shared)")
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    table = {}
    for size in args.sizes:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        out = Path(f"/tmp/tp-bench-{os.getpid()}-{size}.json")
        threads = args.threads or max(1, cores // size)  # as the server shares the cores among its processes
        mp.spawn(rank_main, args=(size, port, threads, args.repeats, str(out)), nprocs=size)
        table[size] = json.loads(out.read_text())
        out.unlink()
    sys.stdout.write(json.dumps({"cores": cores, "median_step_ms": table}, indent=2) + "\n")


if __name__ == "__main__":
    main()
