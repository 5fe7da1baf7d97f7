"""The quantized products (worker/kernels/cpu/kquant_gemm.cpp, vnni_gemm.cpp) against an earlier revision's:
bit for bit, and how fast, in one process.

    python bench/kernels/quantized_gemm_speed.py --old-rev main            # times Q4_K and Q6_K
    python bench/kernels/quantized_gemm_speed.py --old-rev main --check-only --formats all

The earlier revision's kernel source (``git show REV:...``, with the headers beside it) is compiled as
build.py compiles the working tree's; each library packs the weights itself (a layout may change between
revisions: the check says whether the packed bytes changed, and holds the outputs to the same bits either way).

``--check``: both multiply random weights of every format asked for by random activations, for
M = 1..9, 16, 64, 131 rows and 1 and 2 threads; the outputs must be the same bits.

Timing: on the layer shapes of Llama-3.2-1B (K x N = 2048 x 8192, 8192 x 2048, 2048 x 2048) and
M = 1, 16, 64, 512 rows, the old and the new kernel are called in turn (the machine's load falls on
both alike), each ``--repeats`` times; printed are the min and median times and new / old of each.
One weight of these shapes stays in the CPU's last-level cache between calls; decoding reads its
weights from memory. ``--from-memory MB`` gives each call the next of as many copies of the weight as
fill MB (more than the caches hold), and prints the new kernel's best read rate (GB/s of packed weight):

    python bench/kernels/quantized_gemm_speed.py --old-rev main --m 1 --from-memory 512 --no-check
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QType

from tokenmill_service.worker.kernels.cpu import abi, build, huge_pages

KERNEL_DIR = "service/tokenmill_service/worker/kernels/cpu"
# Where each format's float16 scales sit in its GGUF block (the rest of a block is any bytes).
SCALE_FIELDS = {
    QType.Q4_0: (0,),
    QType.Q4_1: (0, 2),
    QType.Q5_0: (0,),
    QType.Q5_1: (0, 2),
    QType.Q8_0: (0,),
    QType.IQ4_NL: (0,),
    QType.MXFP4: (),  # an e8m0 exponent byte (below)
    QType.Q2_K: (80, 82),
    QType.Q3_K: (108,),
    QType.Q4_K: (0, 2),
    QType.Q5_K: (0, 2),
    QType.Q6_K: (208,),
    QType.IQ4_XS: (0,),
}
KQUANTS = {QType.Q2_K, QType.Q3_K, QType.Q4_K, QType.Q5_K, QType.Q6_K, QType.IQ4_XS}
SHAPES = [(2048, 8192), (8192, 2048), (2048, 2048)]  # K, N of Llama-3.2-1B's layers


def kernel_of(qtype: QType) -> tuple[str, str]:
    """The library and its functions' prefix for ``qtype``."""
    return ("kquant_gemm", "tm_kquant") if qtype in KQUANTS else ("vnni_gemm", "tm_vnni")


def old_library(rev: str, name: str, out: Path, isa: str) -> ctypes.CDLL:
    """Kernel ``name`` as revision ``rev`` has it (its sources written under ``out``), built for ``isa``."""
    root = Path(
        subprocess.run(
            ["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, check=True
        ).stdout.strip()
    )
    files = subprocess.run(
        ["git", "ls-tree", "-r", "--name-only", f"{rev}:{KERNEL_DIR}"],
        capture_output=True,
        text=True,
        check=True,
        cwd=root,
    ).stdout.split()
    src = out / rev.replace("/", "_")
    src.mkdir(exist_ok=True)
    for f in files:
        if f.endswith((".h", ".cpp")):
            text = subprocess.run(
                ["git", "show", f"{rev}:{KERNEL_DIR}/{f}"], capture_output=True, text=True, check=True, cwd=root
            ).stdout
            # With its isa/ backends (else simd.h's includes would find the working tree's).
            (src / f).parent.mkdir(parents=True, exist_ok=True)
            (src / f).write_text(text)
    # Built into the servers' kernel cache, by content: a revision whose kernels are the working tree's (HEAD,
    # before an edit) loads the build the servers use, and an earlier one's build is kept for the next run.
    return abi.bind(ctypes.CDLL(str(build.built(name, isa, source=src / f"{name}.cpp"))), name)


def random_blocks(qtype: QType, rows: int, cols: int, rng: np.random.Generator) -> torch.Tensor:
    weights, size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows, cols // weights, size), dtype=np.uint8)
    for at in SCALE_FIELDS[qtype]:
        blocks[..., at : at + 2] = (
            rng.uniform(-0.01, 0.01, size=(rows, cols // weights, 1)).astype(np.float16).view(np.uint8)
        )
    if qtype == QType.MXFP4:  # scales 2^(e - 128) within 2^-20 .. 2^15: what float16 holds
        blocks[..., 0] = rng.integers(108, 144, size=blocks.shape[:-1], dtype=np.uint8)
    return torch.from_numpy(blocks)


def pack(lib: ctypes.CDLL, prefix: str, qtype: QType, blocks: torch.Tensor, k: int) -> torch.Tensor:
    n = blocks.shape[0]
    # In 2 MB pages where the system gives them, as the server's packed weights are (huge_pages.py).
    out = huge_pages.empty_bytes(int(getattr(lib, f"{prefix}_packed_bytes")(int(qtype), n, k)))
    rc = getattr(lib, f"{prefix}_pack")(int(qtype), blocks.contiguous().data_ptr(), n, k, out.data_ptr())
    assert rc == 0, rc
    return out


# "_int8" (--int8): the products with 8-bit activations (--activations int8) rather than the default's.
GEMM_SUFFIX = {"name": ""}


def gemm(
    lib: ctypes.CDLL, prefix: str, qtype: QType, x: torch.Tensor, w: torch.Tensor, n: int, y: torch.Tensor, threads: int
) -> None:
    rc = getattr(lib, f"{prefix}_gemm{GEMM_SUFFIX['name']}")(
        int(qtype), x.data_ptr(), x.shape[0], x.shape[1], w.data_ptr(), n, y.data_ptr(), threads
    )
    assert rc == 0, rc


def check(libs: dict[str, tuple[ctypes.CDLL, ctypes.CDLL]], qtypes: list[QType]) -> bool:
    ok = True
    rng = np.random.default_rng(0)
    for qtype in qtypes:
        name, prefix = kernel_of(qtype)
        old, new = libs[name]
        for n, k in [(16, 256), (97, 512), (200, 768)]:
            blocks = random_blocks(qtype, n, k, rng)
            w_old, w_new = pack(old, prefix, qtype, blocks, k), pack(new, prefix, qtype, blocks, k)
            same_packing = torch.equal(w_old, w_new)  # (a layout may change: each kernel takes its own packing)
            for m in [*range(1, 10), 16, 64, 131]:
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + n))
                x[0, :32] *= 1e-30  # a block of tiny values
                for threads in (1, 2):
                    y_old, y_new = torch.empty(m, n), torch.empty(m, n)
                    gemm(old, prefix, qtype, x, w_old, n, y_old, threads)
                    gemm(new, prefix, qtype, x, w_new, n, y_new, threads)
                    same = torch.equal(y_old.view(torch.int32), y_new.view(torch.int32))
                    ok &= same
                    if not same:
                        diff = (y_old - y_new).abs().max().item()
                        print(f"DIFFERENT {qtype.name} n={n} k={k} m={m} threads={threads}: max |diff| {diff:g}")
            print(f"{qtype.name} n={n} k={k}: packing {'same' if same_packing else 'changed'}, outputs checked")
    return ok


def bench(
    libs: dict[str, tuple[ctypes.CDLL, ctypes.CDLL]],
    qtypes: list[QType],
    shapes: list[tuple[int, int]],
    ms: list[int],
    repeats: int,
    threads: int,
    budget_s: float,
    from_memory_mb: int,
) -> None:
    rng = np.random.default_rng(1)
    print(
        f"{'format':7} {'K':>5} {'N':>5} {'M':>4} {'old min':>9} {'new min':>9} {'min ratio':>9} "
        f"{'med ratio':>9} {'spread':>7} {'new GB/s':>8} {'new GMAC/s':>10}"
    )
    for qtype in qtypes:
        name, prefix = kernel_of(qtype)
        old, new = libs[name]
        for k, n in shapes:
            blocks = random_blocks(qtype, n, k, rng)
            copies = {}  # each kernel's own packing (a layout may change between them)
            for label, lib in (("old", old), ("new", new)):
                w = pack(lib, prefix, qtype, blocks, k)
                copies[label] = [w] + [
                    huge_pages.empty_bytes(w.numel()).copy_(w) for _ in range(from_memory_mb * 2**20 // w.numel())
                ]
            calls = 0
            for m in ms:
                x = torch.randn(m, k)
                y = torch.empty(m, n)
                times: dict[str, list[float]] = {"old": [], "new": []}
                for label, lib in (("old", old), ("new", new)):  # warm up
                    gemm(lib, prefix, qtype, x, copies[label][0], n, y, threads)
                start = time.perf_counter()
                for r in range(repeats):
                    for label, lib in (("old", old), ("new", new)) if r % 2 else (("new", new), ("old", old)):
                        w = copies[label][calls % len(copies[label])]
                        calls += 1
                        t = time.perf_counter()
                        gemm(lib, prefix, qtype, x, w, n, y, threads)
                        times[label].append(time.perf_counter() - t)
                    if time.perf_counter() - start > budget_s and r >= 4:
                        break
                lo = {key: min(v) for key, v in times.items()}
                med = {key: statistics.median(v) for key, v in times.items()}
                # How noisy: the old kernel's median over its min.
                print(
                    f"{qtype.name:7} {k:5} {n:5} {m:4} {lo['old'] * 1e3:8.3f}m {lo['new'] * 1e3:8.3f}m "
                    f"{lo['new'] / lo['old']:9.3f} {med['new'] / med['old']:9.3f} {med['old'] / lo['old']:7.2f} "
                    # (three significant digits: a tiny product on a loaded machine is still above zero)
                    f"{copies['new'][0].numel() / lo['new'] / 1e9:8.3g} {m * n * k / lo['new'] / 1e9:10.3g}",
                    flush=True,
                )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old-rev", default="main", help="the git revision whose kernels are the reference")
    parser.add_argument(
        "--old-isa",
        default="avx512",
        help="the instruction set the reference is built for (revisions before simd.h build for avx512 only); the "
        "new kernels take the process's (TOKENMILL_CPU_ISA)",
    )
    parser.add_argument("--formats", default="Q4_K,Q6_K", help="comma-separated ggml type names, or 'all'")
    parser.add_argument("--m", default="1,16,64,512", help="activation rows to time")
    parser.add_argument("--shapes", default=",".join(f"{k}x{n}" for k, n in SHAPES), help="KxN,... to time")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--budget-s", type=float, default=20.0, help="at most this long on one case")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--from-memory", type=int, default=0, metavar="MB", help="cycle each call over copies of the weight filling MB"
    )
    parser.add_argument("--int8", action="store_true", help="the 8-bit activations' products (--activations int8)")
    parser.add_argument("--check-only", action="store_true")
    parser.add_argument("--no-check", action="store_true")
    args = parser.parse_args()
    GEMM_SUFFIX["name"] = "_int8" if args.int8 else ""
    names = list(SCALE_FIELDS) if args.formats == "all" else [QType[f] for f in args.formats.split(",")]
    libs = {}
    with tempfile.TemporaryDirectory(prefix="tm-old-kernels-") as tmp:
        for name in sorted({kernel_of(q)[0] for q in names}):
            libs[name] = (old_library(args.old_rev, name, Path(tmp), args.old_isa), build.load(name))
        ok = True
        if not args.no_check:
            ok = check(libs, names)
            print("bitwise identical" if ok else "OUTPUTS DIFFER")
        if not args.check_only:
            shapes = [(int(k), int(n)) for k, n in (s.split("x") for s in args.shapes.split(","))]
            bench(
                libs,
                names,
                shapes,
                [int(m) for m in args.m.split(",")],
                args.repeats,
                args.threads,
                args.budget_s,
                args.from_memory,
            )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
