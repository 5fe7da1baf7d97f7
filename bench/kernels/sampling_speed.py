"""How long the sampler takes a step, against a git revision's sampler, alternately in one process.

    python bench/kernels/sampling_speed.py --old-rev main

The engine samples every step's new tokens from the logits (``worker/engine/sampler.py``): greedy rows take the
argmax, sampled rows (temperature, top-k, top-p) a draw. Over a vocabulary of 128k tokens a draw costs
passes over 128k floats, next to a 1B model's forward pass of about 22 ms at one sequence. The rows here
are random logits of three shapes, as the distributions a model gives:

- peaked: a few tokens hold most of the mass (a real model's usual step; its top-p nucleus is small);
- broad: the nucleus at p = 0.9 holds thousands of tokens (a high temperature);
- flat: nearly uniform (random weights, as the shaped benchmark models have).

Printed: the median milliseconds a ``sample`` call takes, old and new, and new / old. ``--old-rev .``
times the working tree against itself (the noise floor).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from tokenmill_service.contract.request import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
SAMPLER = "service/tokenmill_service/worker/engine/sampler.py"
SHAPES = {"peaked": 12.0, "broad": 3.0, "flat": 0.05}  # the logits' standard deviation
MODES: dict[str, dict[str, Any]] = {
    "greedy": {},
    "T 0.7": {"temperature": 0.7},
    "T 1, top-p 0.95": {"temperature": 1.0, "top_p": 0.95},
    "T 0.7, top-k 40": {"temperature": 0.7, "top_k": 40},
}


def sampler_of(rev: str, tmp: Path) -> ModuleType:
    """The sampler module of a git revision ('.': the working tree's), imported under its own name."""
    path = ROOT / SAMPLER
    if rev != ".":
        source = subprocess.run(
            ["git", "show", f"{rev}:{SAMPLER}"], cwd=ROOT, capture_output=True, text=True, check=True
        )
        path = tmp / f"sampler_{rev.replace('/', '_')}.py"
        path.write_text(source.stdout)
    spec = importlib.util.spec_from_file_location(f"sampler_at_{abs(hash(rev))}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def timed(call: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--old-rev", default="main", help="the git revision whose sampler is the reference ('.': the working tree's)"
    )
    parser.add_argument("--vocab", default="49152,128256", help="comma-separated vocabulary sizes")
    parser.add_argument("--batch", default="1,16", help="comma-separated rows a step")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        old, new = sampler_of(args.old_rev, Path(tmp)), sampler_of(".", Path(tmp))
    gen = torch.Generator().manual_seed(0)
    print(f"{'vocab':>7} {'rows':>4}  {'logits':7} {'mode':17} {'old ms':>8} {'new ms':>8} {'new / old':>9}")
    for vocab in (int(v) for v in args.vocab.split(",")):
        for rows in (int(b) for b in args.batch.split(",")):
            for shape, spread in SHAPES.items():
                logits = torch.randn(rows, vocab, generator=gen) * spread
                for mode, settings in MODES.items():
                    params = [SamplingParams(**settings)] * rows
                    seen: list[list[int]] = [[1] for _ in range(rows)]
                    old_call, new_call = (
                        partial(
                            module.sample, logits, params, list(range(rows)), seen, [0] * rows, logprobs=[False] * rows
                        )
                        for module in (old, new)
                    )
                    old_call(), new_call()  # warm
                    t_old = t_new = 0.0
                    for _ in range(2):  # alternately: the machine's load falls on both alike
                        t_old += timed(old_call, args.repeats)
                        t_new += timed(new_call, args.repeats)
                    print(
                        f"{vocab:>7} {rows:>4}  {shape:7} {mode:17} {t_old * 500:8.2f} {t_new * 500:8.2f} {t_new / t_old:9.2f}"
                    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
