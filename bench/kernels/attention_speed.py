"""Decode attention (worker/kernels/cpu/paged_attention.cpp) against an earlier revision's, at a long context,
reading its keys and values from memory as a decoding step does, in one process:

    python bench/kernels/attention_speed.py --old-rev main --context 4000
    python bench/kernels/attention_speed.py --old-rev main --head-dim 128 --kv-cache-dtype float16
    TOKENMILL_CPU_ISA=avx2 python bench/kernels/attention_speed.py --old-rev main --old-isa avx2

One token attends over ``--context`` keys of each of ``--layers`` layers' caches (16 by default: more
than the caches of the CPU hold), its sequence's blocks scattered over the pool as a pool in use hands
them out. The old and the new kernel take the layers in turn, alternately, ``--repeats`` times; printed
are each one's min and median time for the layers and the rate at which it read their keys and values.
The outputs must be the same bits (the script checks). ``--old-rev .`` times the working tree's kernel
against itself: how far apart two runs of the same code come out on this machine. The new kernel is built
for the process's instruction set (TOKENMILL_CPU_ISA), the old one for ``--old-isa``: every build gives the
same bits.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from quantized_gemm_speed import old_library

from tokenmill_service.worker.kernels.cpu import build

BLOCK = 16


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--old-rev", default="main", help="the git revision whose kernel is the reference ('.': the working tree's own)"
    )
    parser.add_argument(
        "--old-isa",
        default="avx512",
        help="the instruction set the reference is built for (revisions before simd.h build for avx512 only)",
    )
    parser.add_argument("--context", type=int, default=4000, help="keys the token attends over")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--kv-cache-dtype", choices=("float32", "float16"), default="float32")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    dtype = torch.float16 if args.kv_cache_dtype == "float16" else torch.float32
    symbol = "tm_paged_attention_f16" if dtype == torch.float16 else "tm_paged_attention"
    heads, kv_heads, dim, n = args.heads, args.kv_heads, args.head_dim, args.context
    blocks = -(-n // BLOCK)
    pool = blocks + 64
    g = torch.Generator().manual_seed(0)
    keys = [torch.randn(pool, kv_heads, dim, BLOCK, generator=g).to(dtype) for _ in range(args.layers)]
    values = [torch.randn(pool, BLOCK, kv_heads, dim, generator=g).to(dtype) for _ in range(args.layers)]
    table = torch.randperm(pool, generator=g)[:blocks].view(1, blocks).contiguous()
    q = torch.randn(1, heads, dim, generator=g)
    positions, seq = torch.tensor([n - 1]), torch.tensor([0])
    read = args.layers * 2 * n * kv_heads * dim * dtype.itemsize

    with tempfile.TemporaryDirectory(prefix="tm-old-kernels-") as tmp:
        new = build.load("paged_attention")
        old = new if args.old_rev == "." else old_library(args.old_rev, "paged_attention", Path(tmp), args.old_isa)
        libs = {"old": old, "new": new}
        outs = {label: torch.empty(args.layers, 1, heads, dim) for label in libs}

        def run(label: str) -> float:
            kernel, out = getattr(libs[label], symbol), outs[label]
            start = time.perf_counter()
            for layer in range(args.layers):
                rc = kernel(
                    ctypes.c_void_p(q.data_ptr()), 1, heads, kv_heads, dim,
                    ctypes.c_void_p(keys[layer].data_ptr()), ctypes.c_void_p(values[layer].data_ptr()), BLOCK,
                    ctypes.c_void_p(positions.data_ptr()), ctypes.c_void_p(seq.data_ptr()),
                    ctypes.c_void_p(table.data_ptr()), blocks, ctypes.c_float(dim**-0.5),
                    ctypes.c_void_p(out[layer].data_ptr()), args.threads,
                )  # fmt: skip
                assert rc == 0, rc
            return time.perf_counter() - start

        times: dict[str, list[float]] = {"old": [], "new": []}
        for r in range(args.repeats):
            for label in ("old", "new") if r % 2 else ("new", "old"):
                times[label].append(run(label))
        same = torch.equal(outs["old"].view(torch.int32), outs["new"].view(torch.int32))
    print(
        f"{args.layers} layers x {n} keys, {kv_heads} KV heads of {dim}, {args.kv_cache_dtype}: "
        f"{read / 1e6:.0f} MB of keys and values; outputs {'bitwise identical' if same else 'DIFFER'}"
    )
    for label, ts in times.items():
        lo, med = min(ts), statistics.median(ts)
        print(
            f"{label}: min {lo * 1e3:.2f} ms, median {med * 1e3:.2f} ms; "
            f"{read / lo / 1e9:.1f} GB/s at best, {read / med / 1e9:.1f} at the median"
        )
    print(
        f"new / old: {min(times['new']) / min(times['old']):.3f} (min), "
        f"{statistics.median(times['new']) / statistics.median(times['old']):.3f} (median)"
    )
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
