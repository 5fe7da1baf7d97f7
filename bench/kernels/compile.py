"""What one engine step costs eager and with ``--compile auto``, measured alternately in one process.

    python bench/kernels/compile.py --repeats 10

The default configuration (the embedded model, its blocks as stored, float32 activations). One model is
loaded; its regions are compiled (the time is reported, as the worker's warm-up would pay it) and
then switched between eager and compiled for every repeat, so the two columns see the same machine
load. Reported: the median wall time of a step, for decode steps of 1, 16 and 64 sequences (100
tokens of context each) and a 128-token prefill.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tokenmill_service.worker.engine.compile import compiled_graphs
from tokenmill_service.worker.engine.model_runner import ModelRunner, StepPlan
from tokenmill_service.worker.loader import load_model, resolve_model_path

BLOCK = 16
PREFILL = 128


def plans() -> dict[str, StepPlan]:
    """Steps of fixed shapes over a pool where sequence i owns blocks [i * 16, i * 16 + 16)."""

    def decode(n: int) -> StepPlan:
        tables = [list(range(i * 16, i * 16 + 16)) for i in range(n)]
        return StepPlan([5] * n, [1] * n, [100] * n, tables, list(range(n)), [])

    prefill = StepPlan(list(range(1, PREFILL + 1)), [PREFILL], [0], [list(range(16))], [PREFILL - 1], [])
    return {"decode, 1 sequence": decode(1), "decode, 16": decode(16), "decode, 64": decode(64), "prefill 128": prefill}


def time_step(runner: ModelRunner, plan: StepPlan, steps: int) -> float:
    runner.execute(plan)
    start = time.perf_counter()
    for _ in range(steps):
        runner.execute(plan)
    return (time.perf_counter() - start) / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=6, help="alternations of eager and compiled")
    parser.add_argument("--steps", type=int, default=3, help="steps timed per shape and repeat")
    args = parser.parse_args()

    path = resolve_model_path(None)
    # The default plan's executor (the native stack here) against compiled regions, on one model.
    model = load_model(path, quantization="auto", compile="auto")
    assert model.plan.executor.value == "compiled", f"torch.compile is unavailable here: {model.plan.skipped}"
    runners = {
        "eager": ModelRunner(model, BLOCK, 64 * 16, "native-stack"),
        "compiled": ModelRunner(model, BLOCK, 64 * 16),
    }
    shapes = plans()
    start = time.perf_counter()
    for plan in shapes.values():
        runners["compiled"].execute(plan)
    built = time.perf_counter() - start
    times: dict[str, dict[str, list[float]]] = {name: {"eager": [], "compiled": []} for name in shapes}
    for _ in range(args.repeats):
        for mode, runner in runners.items():
            for name, plan in shapes.items():
                times[name][mode].append(time_step(runner, plan, args.steps))

    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; {compiled_graphs()} graphs built in {built:.1f} s"
    )
    print("| step | eager ms | compiled ms | compiled / eager |")
    print("|---|---|---|---|")
    for name, by_mode in times.items():
        eager, compiled = statistics.median(by_mode["eager"]), statistics.median(by_mode["compiled"])
        print(f"| {name} | {eager:.1f} | {compiled:.1f} | {compiled / eager:.2f} |")


if __name__ == "__main__":
    main()
