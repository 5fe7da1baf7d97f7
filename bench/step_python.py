"""Where one decoding stream's step goes inside the worker, without the server: the engine is built as a worker
builds it (the default configuration for ``--model``) and stepped in this process, its native calls and the Python
around them each timed, and what is left (the engine's and the executor's Python) shown beside them:

    python bench/step_python.py --model FILE.gguf [--tokens 100] [--runs 3]

Each run sends one greedy request of ``--tokens`` tokens after its prompt's step, and prints the mean per token of:
the scheduler's choice, the step's plan, the embedding lookup, the decoder stack and the output layer (the native
calls), the sampler, and the rest. The Python between the native calls runs cold: the step's weights have streamed
through the caches (bench/history.md, "night"), so it takes longer here than alone in a loop.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from typing import Any

import structlog

from tokenmill_service.contract.config import load_settings
from tokenmill_service.contract.request import GenerationRequest, StoppingParams
from tokenmill_service.front.router.spec import free_port, worker_spec
from tokenmill_service.worker import worker

PROMPT = [1 + (i * 7919) % 4000 for i in range(32)]  # ordinary vocabulary ids, as tokenmill-bench's


def timed(owner: Any, name: str, label: str, sums: dict[str, int]) -> None:
    """``owner.name`` replaced by itself adding its time to ``sums[label]`` (nanoseconds)."""
    inner = getattr(owner, name)

    @functools.wraps(inner)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter_ns()
        try:
            return inner(*args, **kwargs)
        finally:
            sums[label] = sums.get(label, 0) + time.perf_counter_ns() - started

    setattr(owner, name, wrapper)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    port = free_port()
    spec = worker_spec(load_settings(["--model", args.model, "--speculative-tokens", "0"]), 1, 0, 0, port)
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    engine = worker._start_engine(spec, structlog.get_logger("step_python"), worker._model_file(spec))
    sums: dict[str, int] = {}
    executor = engine.runner.executor
    if not hasattr(executor, "stack"):
        print(f"the model runs on the {executor.kind} executor here, not the native stack: nothing to split")
        return 1
    timed(type(executor.stack), "__call__", "decoder stack (native)", sums)
    timed(executor, "compute_logits", "output layer (native, with its Python)", sums)
    timed(executor.model.model, "embed", "embedding lookup", sums)
    timed(engine.scheduler, "schedule", "scheduler", sums)
    timed(engine.runner, "plan", "plan", sums)
    timed(engine, "_sample", "sampler", sums)
    native = ("decoder stack (native)", "output layer (native, with its Python)")
    for run in range(args.runs + 1):  # the first warms up
        stopping = StoppingParams(max_new_tokens=args.tokens, ignore_eos=True)
        engine.add_request(GenerationRequest(f"run-{run}", PROMPT, stopping=stopping))
        engine.step()  # the prompt
        sums.clear()
        steps, started = 0, time.perf_counter_ns()
        while engine.has_unfinished():
            engine.step()
            steps += 1
        if run == 0:
            continue
        step = (time.perf_counter_ns() - started) / steps / 1e6
        parts = {label: ns / steps / 1e6 for label, ns in sums.items()}
        rest = step - sum(parts.values())
        python = step - sum(parts[label] for label in native)
        print(
            f"run {run}: a step {step:.3f} ms; outside the native calls {python:.3f} ms ({100 * python / step:.1f} %)"
        )
        for label, ms in [*parts.items(), ("the rest (the engine's and the executor's Python)", rest)]:
            print(f"  {label:<52} {ms:8.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
