"""A step over 8 LoRA adapters against the same step on the base, in one process, alternately.

    python bench/kernels/lora_step.py --repeats 15
    OMP_WAIT_POLICY=passive python bench/kernels/lora_step.py   # CPU time without spinning waits

The embedded model with ``--max-loras 8`` slots of rank 16 (what ``tokenmill-bench lora`` serves), 8
random adapters on every projection written into them, and the native decoder stack's forward timed
on two steps as a server at 64 streams schedules them: ``mixed``, 45 decoding sequences and 6 new
32-token prompts (237 tokens), and ``decode``, 64 decoding sequences; each once with every sequence on
the base and once with sequence i on adapter i mod 8, the two taking turns. Printed per step and side:
the wall time and the process's CPU time (both threads), minimum and median, and base ÷ adapters
(min over min, and the median of the turns' ratios). The CPU time leaves out the machine's other
load only where waiting threads sleep (OMP_WAIT_POLICY=passive); by default they spin.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from tokenmill_bench.lora import base_dims, write_adapter
from tokenmill_bench.model import default_model_path
from tokenmill_service.contract.plan.options import LoadOptions
from tokenmill_service.worker.engine.model_runner import ModelRunner, StepPlan
from tokenmill_service.worker.kernels.attention_metadata import build_attention_metadata
from tokenmill_service.worker.loader import load

BLOCK = 16
STEPS = {"mixed": (6, 45), "decode": (0, 64)}  # (new 32-token prompts, decoding sequences)


def step_plans(prompts: int, decoding: int, adapters: int, seed: int = 0) -> tuple[StepPlan, StepPlan]:
    """The step on the base and over the adapters: the same tokens, positions and blocks."""
    rng = random.Random(seed)
    ids: list[int] = []
    lens: list[int] = []
    starts: list[int] = []
    tables: list[list[int]] = []
    sample: list[int] = []
    blocks = 0
    for start, n in [(rng.randint(40, 90), 1) for _ in range(decoding)] + [(0, 32)] * prompts:
        used = -(-(start + n) // BLOCK)
        tables.append(list(range(blocks, blocks + used)))
        blocks += used
        ids += [rng.randrange(1000, 40000) for _ in range(n)]
        lens.append(n)
        starts.append(start)
        sample.append(sum(lens) - 1)
    seqs = len(lens)
    base = StepPlan(ids, lens, starts, tables, sample, [], adapter_slots=[-1] * seqs)
    spread = StepPlan(ids, lens, starts, tables, sample, [], adapter_slots=[i % adapters for i in range(seqs)])
    return base, spread


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    model = load(LoadOptions(max_loras=args.adapters, max_lora_rank=args.rank))
    path = default_model_path()
    assert path is not None, "the embedded model is not installed"
    with tempfile.TemporaryDirectory() as root:
        for i in range(args.adapters):
            written = write_adapter(Path(root) / f"a{i}", base_dims(path), args.rank, seed=i + 1)
            model.lora.load(i, f"a{i}", str(written))
    runner = ModelRunner(model, block_size=BLOCK, num_blocks=1024)
    print(f"threads {torch.get_num_threads()}, {args.adapters} adapters of rank {args.rank}")
    with torch.inference_mode():
        for name, (prompts, decoding) in STEPS.items():
            plans = dict(zip(("base", "adapters"), step_plans(prompts, decoding, args.adapters), strict=True))
            inputs = {}
            for side, plan in plans.items():
                positions = [s + j for s, n in zip(plan.starts, plan.query_lens, strict=True) for j in range(n)]
                meta = build_attention_metadata(
                    plan.query_lens, plan.starts, plan.block_tables, runner.k_cache, runner.v_cache
                )
                inputs[side] = (torch.tensor(plan.token_ids), torch.tensor(positions), meta)
            wall: dict[str, list[float]] = {side: [] for side in plans}
            cpu: dict[str, list[float]] = {side: [] for side in plans}
            for turn in range(args.repeats + 2):
                for side in ("base", "adapters") if turn % 2 == 0 else ("adapters", "base"):
                    runner._set_adapters(plans[side])  # the step's tokens by slot, as execute() sets them
                    c0, t0 = time.process_time(), time.perf_counter()
                    runner.executor.forward(*inputs[side])
                    if turn >= 2:  # the first two turns warm up
                        wall[side].append(time.perf_counter() - t0)
                        cpu[side].append(time.process_time() - c0)
            tokens = len(plans["base"].token_ids)
            for kind, times in (("wall", wall), ("cpu", cpu)):
                b, a = times["base"], times["adapters"]
                turns = statistics.median(x / y for x, y in zip(b, a, strict=True))
                print(
                    f"{name:6} {tokens:3} tokens, {kind:4}: base {min(b) * 1e3:6.1f} ms min "
                    f"{statistics.median(b) * 1e3:6.1f} median | adapters {min(a) * 1e3:6.1f} min "
                    f"{statistics.median(a) * 1e3:6.1f} median | base/adapters {min(b) / min(a):.3f} (min), "
                    f"{turns:.3f} (median of turns)"
                )


if __name__ == "__main__":
    main()
