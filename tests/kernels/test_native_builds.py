"""On a CPU the native kernels are written for, every one of them builds: the kernel tests skip a kernel
that cannot be built (right on a machine without AVX-512 or a compiler), so a source that stops
compiling must fail here instead of turning its tests into skips."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tokenmill_service.kernels.cpu import build

NEEDED = {"avx512f", "avx512bw", "avx512_vnni", "f16c"}


def _cpu_flags() -> set[str]:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return set()
    return set(next((line.split(":", 1)[1] for line in lines if line.startswith("flags")), "").split())


@pytest.mark.skipif(shutil.which("g++") is None or not NEEDED <= _cpu_flags(), reason="needs g++ and AVX-512 with VNNI")
@pytest.mark.parametrize("name", sorted(p.stem for p in build.HERE.glob("*.cpp")))
def test_every_native_kernel_builds_on_a_cpu_it_is_written_for(name: str) -> None:
    assert build.unavailable_reason(name) is None


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_a_built_kernel_loads_for_another_user_of_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The image builds its kernels as root and runs as another user: a private file would not load.
    monkeypatch.setenv("TOKENMILL_KERNEL_CACHE", str(tmp_path))
    library = build._build("elementwise", str(shutil.which("g++")))
    assert library.parent == tmp_path and library.stat().st_mode & 0o777 == 0o755
