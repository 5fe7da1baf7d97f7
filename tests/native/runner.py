"""Building and running the bit-for-bit checks (check_*.cpp beside this file): each loads two builds of one
kernel library, the scalar definition and one instruction set's, calls both with the same inputs and
compares every output. On x86 they run natively; the ARM64 builds are cross-compiled and run under
qemu-aarch64 (``make test-arm``)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tokenmill_service.contract.plan import cpu_isa
from tokenmill_service.worker.kernels.cpu import build

HERE = Path(__file__).parent
KERNELS = build.HERE
# The ARM64 tool chain and emulator (Debian: g++-aarch64-linux-gnu, qemu-user).
ARM_CXX = "aarch64-linux-gnu-g++"
QEMU = "qemu-aarch64"
ARM_SYSROOT = "/usr/aarch64-linux-gnu"


@dataclass(frozen=True)
class Check:
    name: str  # "simd" or a kernel's library name ("vnni_gemm")
    source: Path  # check_<name>.cpp

    @property
    def library_source(self) -> Path:
        """What the check loads twice: the kernel's source, or for simd.h its op probe."""
        return HERE / "simd_probe.cpp" if self.name == "simd" else KERNELS / f"{self.name}.cpp"


def checks() -> list[Check]:
    return [Check(p.stem.removeprefix("check_"), p) for p in sorted(HERE.glob("check_*.cpp"))]


def arm_tools_missing() -> str | None:
    """None when the ARM64 checks can run here; else what to install."""
    lacking = [tool for tool in (ARM_CXX, QEMU) if shutil.which(tool) is None]
    if lacking:
        return f"{' and '.join(lacking)} not installed (Debian: apt-get install g++-aarch64-linux-gnu qemu-user)"
    return None


def libraries(check: Check, isa: str, cxx: str = "g++") -> dict[str, Path]:
    """``check``'s library built for scalar and for ``isa`` (cached as the server's kernels are)."""
    return {which: libraries_one(check, which, cxx) for which in ("scalar", isa)}


def build_all(pairs: list[tuple[Check, str]], cxx: str = "g++") -> None:
    """Builds every pair's libraries ahead, two compilers at a time (the machines here have two cores)."""
    from concurrent.futures import ThreadPoolExecutor

    jobs = {(c.name, which): c for c, isa in pairs for which in ("scalar", isa)}
    with ThreadPoolExecutor(max_workers=2) as pool:
        for future in [pool.submit(libraries_one, check, which, cxx) for (_, which), check in jobs.items()]:
            future.result()


def libraries_one(check: Check, which: str, cxx: str) -> Path:
    """``check``'s library for one instruction set: the kernel's own (shared with the server's cache), or the
    op probe."""
    if check.name == "simd":
        return build.built("simd_probe", which, cxx, check.library_source)
    return build.built(check.name, which, cxx)


def run_check(check: Check, isa: str, workdir: Path, cxx: str = "g++") -> subprocess.CompletedProcess[str]:
    """Builds ``check``'s library for scalar and for ``isa`` with ``cxx`` and the check program, and runs it
    (under qemu for a cross compiler); the result's returncode is 0 when every output is the same."""
    libs = libraries(check, isa, cxx)
    program = workdir / f"check_{check.name}"
    subprocess.run(
        [cxx, "-O1", "-std=c++17", "-I", str(HERE), "-o", str(program), str(check.source), "-ldl"],
        check=True,
        capture_output=True,
        text=True,
    )
    cmd = [str(program), str(libs["scalar"]), str(libs[isa])]
    if cxx == ARM_CXX:
        cmd = [QEMU, "-L", ARM_SYSROOT, *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)


# -- the suite's builds ------------------------------------------------------------------------------------

# The test files that load other instruction sets' builds than this CPU's own (or the ARM64 cross builds).
LOAD_OTHER_BUILDS = frozenset({"test_arm64.py", "test_instruction_sets.py", "test_native_builds.py", "test_cpu_isa_bits.py"})  # fmt: skip

_background: subprocess.Popen[bytes] | None = None


def prebuild_own() -> None:
    """At the suite's start: the kernels this CPU's servers load (its own instruction set's), a compiler a core
    (cached: a few seconds once built), rather than one at a time as the tests first load them."""
    if shutil.which(os.environ.get("CXX", "g++")) is not None:
        build.prebuild(isas=[cpu_isa.selected()])


Job = tuple[str, str, str | None, Path | None]  # build.built's arguments: kernel, instruction set, compiler, source


def other_builds() -> list[Job]:
    """The other instruction sets' builds (the plain C++ ones first: the slowest) and the ARM64 cross builds."""
    own = cpu_isa.selected()
    jobs: list[Job] = [
        (name, isa, None, None)
        for isa in sorted((i for i in cpu_isa.runnable() if i != own), key=lambda i: i != "scalar")
        for name in sorted(p.stem for p in KERNELS.glob("*.cpp"))
    ]
    if arm_tools_missing() is None:
        jobs += [
            (c.name if c.name != "simd" else "simd_probe", which, ARM_CXX, c.library_source if c.name == "simd" else None)
            for c in checks()
            for which in ("scalar", "neon")
        ]  # fmt: skip
    return jobs


def start_the_other_builds() -> None:
    """``other_builds``, which only the bit-for-bit checks load, in the background at the lowest priority, on
    what CPU the tests before them leave idle (on a fresh machine they take two minutes of both cores): a
    process of its own, background_builds.py. ``wait_for_the_other_builds`` before loading them."""
    global _background
    if shutil.which(os.environ.get("CXX", "g++")) is None or _background is not None:
        return
    _background = subprocess.Popen(
        [sys.executable, "-m", "tests.native.background_builds"], cwd=HERE.parents[1], start_new_session=True
    )


def wait_for_the_other_builds() -> None:
    """Until the background builds are done (at once when there are none), so that a check does not build the
    same library again beside them, at full priority."""
    if _background is not None:
        _background.wait()


def stop_the_other_builds() -> None:
    """At the session's end: no new build starts, and the ones under way are let finish (a compiler's file is
    renamed into the cache only when whole)."""
    if _background is not None and _background.poll() is None:
        _background.send_signal(signal.SIGTERM)
        try:
            _background.wait(timeout=120)
        except subprocess.TimeoutExpired:
            _background.kill()
