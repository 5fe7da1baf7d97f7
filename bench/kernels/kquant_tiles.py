"""The k-quant products' tiles in cache: variants of kquant_gemm.cpp built with -D overrides (KQUANT_MT, ...),
each held bit for bit to the default build of the same instruction set, and timed as G multiply-adds a second.

    python bench/kernels/kquant_tiles.py --isa avx2 --variant "" --variant "-DKQUANT_MT=3 -DKQUANT_NG=1 ..."

A variant is one string of g++ flags ("" is the working tree's default, the servers' own build from build.py's
cache); every other is built from the working tree's kquant_gemm.cpp for ``--isa`` (as build.py builds it, the
flags added last). Timing: the variants are called
in turn on the same packed weight (one of the 1B's shapes stays in the last-level cache), best of ``--repeats``;
printed with the share of ``--peak`` (G multiply-adds a second of one core's product instruction: cpu_peak.cpp's
vpmaddwd-ymm on AVX2, about 97 on an AMD EPYC Zen 4) times the threads.
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as QType
from quantized_gemm_speed import pack, random_blocks

from tokenmill_service.worker.kernels.cpu import abi, build


def variant_library(isa: str, flags: str, out: Path, index: int) -> ctypes.CDLL:
    if not flags.strip():  # the default: the servers' own build, from build.py's cache
        return abi.bind(ctypes.CDLL(str(build.built("kquant_gemm", isa))), "kquant_gemm")
    target = out / f"kquant_gemm-{index}.so"
    with tempfile.TemporaryDirectory(prefix="tm-abi-") as include:
        (Path(include) / "tm_abi.h").write_text(abi.header())
        cmd = [
            "g++",
            *build.FLAGS,
            *build.isa_flags(isa),
            *flags.split(),
            "-I",
            include,
            "-I",
            str(build.HERE),
            "-o",
            str(target),
            str(build.HERE / "kquant_gemm.cpp"),
        ]
        subprocess.run(cmd, check=True)
    return abi.bind(ctypes.CDLL(str(target)), "kquant_gemm")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--isa", default="avx2")
    parser.add_argument("--variant", action="append", help="g++ flags of one variant ('' the default)")
    parser.add_argument("--formats", default="Q4_K,Q6_K")
    parser.add_argument("--shapes", default="2048x2048,2048x8192,8192x2048,2048x512", help="KxN,...")
    parser.add_argument("--m", default="64,256,512")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--peak", type=float, default=97.0, help="G multiply-adds a second of one core")
    parser.add_argument("--int8", action="store_true", help="tm_kquant_gemm_int8 (the 8-bit activations)")
    args = parser.parse_args()
    variants = args.variant or [""]
    suffix = "_int8" if args.int8 else ""
    rng = np.random.default_rng(1)
    ok = True
    with tempfile.TemporaryDirectory(prefix="tm-kquant-tiles-") as tmp:
        libs = [variant_library(args.isa, flags, Path(tmp), i) for i, flags in enumerate(variants)]
        for i, flags in enumerate(variants):
            print(f"v{i}: {flags or '(default)'}")
        print(
            f"{'format':7} {'K':>5} {'N':>5} {'M':>4} {'thr':>3} "
            + " ".join(f"{'v' + str(i) + ' G/s  %':>13}" for i in range(len(libs)))
        )
        for name in args.formats.split(","):
            qtype = QType[name]
            for shape in args.shapes.split(","):
                k, n = (int(v) for v in shape.split("x"))
                w = pack(libs[0], "tm_kquant", qtype, random_blocks(qtype, n, k, rng), k)
                for m in (int(v) for v in args.m.split(",")):
                    x = torch.randn(m, k)
                    for threads in (int(v) for v in args.threads.split(",")):
                        ys = [torch.empty(m, n) for _ in libs]
                        best = [float("inf")] * len(libs)
                        for r in range(args.repeats + 1):  # the first round warms up
                            for i, lib in enumerate(libs):
                                t = time.perf_counter()
                                rc = getattr(lib, f"tm_kquant_gemm{suffix}")(
                                    int(qtype), x.data_ptr(), m, k, w.data_ptr(), n, ys[i].data_ptr(), threads
                                )
                                assert rc == 0, rc
                                if r:
                                    best[i] = min(best[i], time.perf_counter() - t)
                        same = all(torch.equal(ys[0], y) for y in ys[1:])
                        ok &= same
                        cells = []
                        for b in best:
                            rate = m * n * k / b / 1e9
                            cells.append(f"{rate:7.1f} {100 * rate / (args.peak * threads):4.0f}%")
                        print(
                            f"{name:7} {k:5} {n:5} {m:4} {threads:3} "
                            + " ".join(f"{c:>13}" for c in cells)
                            + ("" if same else "  OUTPUTS DIFFER"),
                            flush=True,
                        )
    print("bitwise identical" if ok else "OUTPUTS DIFFER")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
