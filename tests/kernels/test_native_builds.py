"""Every native kernel builds for every instruction set this CPU runs (scalar always, then AVX2, AVX-512 or
ARM64 NEON): the kernel tests skip a kernel that cannot be built (right on a machine without a compiler), so
a source that stops compiling must fail here instead of turning its tests into skips."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.native import runner
from tokenmill_service.contract.plan import cpu_isa
from tokenmill_service.worker.kernels.cpu import build

ISAS = [s.name for s in cpu_isa.INSTRUCTION_SETS]


@pytest.fixture(scope="module", autouse=True)
def _other_builds_done() -> None:
    runner.wait_for_the_other_builds()


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("name", sorted(p.stem for p in build.HERE.glob("*.cpp")))
def test_every_native_kernel_builds_for_every_instruction_set_the_cpu_runs(name: str, isa: str) -> None:
    if (why := cpu_isa.missing(isa)) is not None:
        pytest.skip(f"the {isa} build: {why}")
    assert build.unavailable_reason(name, isa) is None


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_a_built_kernel_loads_for_another_user_of_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The image builds its kernels as root and runs as another user: a private file would not load.
    monkeypatch.setenv("TOKENMILL_KERNEL_CACHE", str(tmp_path))
    library = build._build("elementwise", str(shutil.which("g++")), "scalar")
    assert library.parent == tmp_path and library.stat().st_mode & 0o777 == 0o755


COUNTING_COMPILER = """#!/bin/sh
# Counts its builds (a line each in $0.calls), takes a while over each, and writes an empty library.
if [ "$1" = "--version" ]; then echo "g++ (counting) 13.2.0"; exit 0; fi
echo build >> "$0.calls"
sleep 1
while [ "$#" -gt 0 ]; do if [ "$1" = "-o" ]; then : > "$2"; fi; shift; done
"""


def test_processes_starting_together_build_a_kernel_once(tmp_path: Path) -> None:
    """Workers starting together on a fresh machine: the second waits for the first one's build of a library
    rather than compiling the same source beside it (each is its own process, so the lock is the file's)."""

    compiler = tmp_path / "g++"
    compiler.write_text(COUNTING_COMPILER)
    compiler.chmod(0o755)
    script = (
        "import sys; from tokenmill_service.worker.kernels.cpu import build; "
        "print(build.built('elementwise', 'scalar', sys.argv[1]))"
    )
    env = {**os.environ, "TOKENMILL_KERNEL_CACHE": str(tmp_path / "cache")}
    procs = [
        subprocess.Popen([sys.executable, "-c", script, str(compiler)], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    paths = {proc.communicate(timeout=120)[0].splitlines()[-1] for proc in procs}  # (after its log line)
    assert all(proc.returncode == 0 for proc in procs)
    assert len(paths) == 1 and Path(paths.pop()).exists()
    assert (tmp_path / "g++.calls").read_text().splitlines() == ["build"]


def test_a_copy_of_the_kernels_folder_is_the_same_build_until_a_header_beside_it_changes(tmp_path: Path) -> None:
    """An earlier revision's copy of the folder (what the kernel benches build to compare with) shares the cached
    build when its files are the working tree's, and a header changed in the copy makes it another build."""
    cxx = shutil.which("g++") or "g++"
    copy = tmp_path / "kernels"
    shutil.copytree(build.HERE, copy, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    own = build.library_name("kquant_gemm", cxx, "avx2", build.HERE / "kquant_gemm.cpp")
    assert build.library_name("kquant_gemm", cxx, "avx2", copy / "kquant_gemm.cpp") == own
    header = next(p for p in sorted(copy.rglob("*.h")) if p.parent != copy)  # one under isa/
    header.write_text(header.read_text() + "\n// changed\n")
    assert build.library_name("kquant_gemm", cxx, "avx2", copy / "kquant_gemm.cpp") != own
