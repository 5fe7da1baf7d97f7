"""Where one prompt's prefill time goes, in one process: a GGUF model loaded as the server loads it, one prompt
of ``--tokens`` run as a single prefill (model_runner.forward_prompt) after a warm-up, with the native decoder
stack's profile (TM_STACK_PROFILE=1: its products, attention, and the whole stack) and the wall time around it.

    python bench/kernels/prefill_profile.py --model /path/llama-3.2-1b-q4_k_m.gguf --cpu-isa avx2 --tokens 512

Printed per run (ms): the wall time of forward_prompt, the stack's products (their activations' quantization
included), attention, the rest of the stack (norms, rotary, cache writes, residual adds, the activation), and
what is outside the stack (the embedding, the executor's Python; forward_prompt computes no logits).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("TM_STACK_PROFILE", "1")  # read when the stack's library loads

import torch

from tokenmill_service.contract.plan import LoadOptions
from tokenmill_service.worker.engine.model_runner import forward_prompt
from tokenmill_service.worker.kernels.cpu import stack_profile
from tokenmill_service.worker.loader import load


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--cpu-isa", default="auto")
    parser.add_argument("--activations", default="auto")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load(LoadOptions(model=args.model, cpu_isa=args.cpu_isa, activations=args.activations))
    ids = [1 + (i * 7919) % 4000 for i in range(args.tokens)]
    forward_prompt(model, ids[:32])  # warm-up: the kernels built and loaded
    stack_profile.read_and_reset()
    print(f"{'wall':>8} {'products':>9} {'attention':>9} {'stack rest':>10} {'outside':>8}")
    for _ in range(args.runs):
        t = time.perf_counter()
        forward_prompt(model, ids)
        wall = (time.perf_counter() - t) * 1e3
        p = stack_profile.read_and_reset()
        products, attention, stack = p["stack_products_ms"], p["stack_attention_ms"], p["stack_ms"]
        print(
            f"{wall:8.0f} {products:9.0f} {attention:9.0f} {stack - products - attention:10.0f} {wall - stack:8.0f}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
