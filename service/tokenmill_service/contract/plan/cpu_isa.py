"""Which instruction set the native CPU kernels are built for: read once from the CPU's flags, or forced.

Every kernel is one source written in worker/kernels/cpu/simd.h's 16-lane ops and built once per instruction
set (worker/kernels/cpu/isa/<name>.h is the backend). Torch-free: the server checks ``--cpu-isa`` at start. All builds give the same bits, the scalar one defining them, so the
choice changes speed only: a stream resumed on a replica whose CPU differs continues bit for bit.

``--cpu-isa`` (``TOKENMILL_CPU_ISA`` in the worker's environment) forces one; ``auto`` takes the
fastest the CPU runs. One the CPU lacks is refused with the flags it is missing.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass
from pathlib import Path

ENV = "TOKENMILL_CPU_ISA"


@dataclass(frozen=True, slots=True)
class InstructionSet:
    name: str
    # The machine it runs on (platform.machine()), None: any.
    machine: str | None
    # The CPU's flags it needs (/proc/cpuinfo's "flags" on x86, "Features" on ARM).
    needs: frozenset[str]
    # g++'s flags for it (besides the common ones in build.py).
    flags: tuple[str, ...]
    # What a person reads in the load plan.
    description: str


# Fastest first: auto takes the first one the CPU has.
INSTRUCTION_SETS = (
    InstructionSet(
        "avx512",
        "x86_64",
        frozenset({"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni", "avx2", "fma", "f16c"}),
        ("-march=x86-64-v4", "-mavx512vnni", "-mtune=generic"),
        "AVX-512 with VNNI",
    ),
    InstructionSet(
        "avx2vnni",
        "x86_64",
        frozenset({"avx2", "fma", "f16c", "bmi2", "avx_vnni"}),
        ("-march=x86-64-v3", "-mavxvnni", "-mtune=generic"),
        "AVX2 with FMA, F16C and AVX-VNNI's byte and word products",
    ),
    InstructionSet(
        "avx2",
        "x86_64",
        frozenset({"avx2", "fma", "f16c", "bmi2"}),
        ("-march=x86-64-v3", "-mtune=generic"),
        "AVX2 with FMA and F16C",
    ),
    InstructionSet(
        "neon",
        "aarch64",
        frozenset({"asimd", "asimddp", "fphp", "asimdhp"}),
        ("-march=armv8.2-a+dotprod+fp16",),
        "ARM64 NEON with the dot product",
    ),
    # -O2: the plain C++ builds took 50 s at -O3 on two cores, 16 s at -O2 (its vectorizer's work on the 16-lane
    # loops); the bits are the source's either way (no fast-math, no contraction: build.py's flags).
    InstructionSet("scalar", None, frozenset(), ("-O2",), "plain C++ (the reference every other build equals)"),
)
BY_NAME = {s.name: s for s in INSTRUCTION_SETS}
# --cpu-isa's values (contract/plan/choices.py shows them), slowest first.
CHOICES = ("auto", *(s.name for s in reversed(INSTRUCTION_SETS)))


@dataclass(frozen=True, slots=True)
class Choice:
    name: str
    reason: str


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux lists them (empty where /proc/cpuinfo cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def machine() -> str:
    m = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(m, m)


def missing(name: str, flags: frozenset[str] | None = None, arch: str | None = None) -> str | None:
    """None when this CPU runs instruction set ``name``; otherwise what it lacks."""
    isa = BY_NAME[name]
    arch = arch or machine()
    if isa.machine is not None and isa.machine != arch:
        return f"{name} is for {isa.machine} CPUs and this one is {arch}"
    lacking = sorted(isa.needs - (cpu_flags() if flags is None else flags))
    if lacking:
        return f"this CPU lacks {', '.join(lacking)}"
    return None


def runnable(flags: frozenset[str] | None = None, arch: str | None = None) -> list[str]:
    """The instruction sets this CPU runs, fastest first (always ending in scalar)."""
    return [s.name for s in INSTRUCTION_SETS if missing(s.name, flags, arch) is None]


def choose(requested: str = "auto", flags: frozenset[str] | None = None, arch: str | None = None) -> Choice:
    """The instruction set to build the kernels for, and why; ValueError for one this CPU cannot run."""
    if requested not in CHOICES:
        raise ValueError(f"--cpu-isa must be one of {', '.join(CHOICES)}, not {requested!r}")
    if requested != "auto":
        if (why := missing(requested, flags, arch)) is not None:
            raise ValueError(f"--cpu-isa {requested} cannot run here: {why}")
        return Choice(requested, f"asked (--cpu-isa {requested}); every instruction set gives the same bits")
    best = runnable(flags, arch)[0]
    if best == "scalar":
        return Choice(
            "scalar",
            f"this {machine()} CPU has none of tokenmill's vector instruction sets (AVX2, AVX-512, ARM64 NEON with the "
            "dot product): the plain C++ kernels, several times slower",
        )
    return Choice(best, f"the fastest this CPU runs: {BY_NAME[best].description}")


def selected() -> str:
    """This process's instruction set: TOKENMILL_CPU_ISA if set (the worker sets it from --cpu-isa), else auto's
    choice. A value the CPU cannot run raises ValueError."""
    return _chosen(os.environ.get(ENV, "") or "auto").name


@functools.cache
def _chosen(requested: str) -> Choice:
    return choose(requested)


def use(requested: str) -> Choice:
    """Makes ``requested`` (``--cpu-isa``) this process's instruction set, and its ranks' (the environment is
    inherited): the choice and its reason, or ValueError naming what the CPU lacks."""
    choice = choose(requested)
    os.environ[ENV] = choice.name
    return choice
