"""The ARM64 NEON kernels give the scalar bits: each kernel and simd.h's op probe cross-compiled for
AArch64 twice (the scalar definition and NEON with the dot product) and compared under qemu-aarch64 by the
same check programs the x86 builds run (tests/native/). ``make test-arm`` runs this file alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.native import runner


@pytest.fixture(scope="module")
def prebuilt() -> None:
    """Every library the checks load, cross-compiled ahead on both cores (cached beside the server's kernels)."""
    if runner.arm_tools_missing() is None:
        runner.wait_for_the_other_builds()
        runner.build_all([(c, "neon") for c in runner.checks()], cxx=runner.ARM_CXX)


@pytest.mark.skipif(runner.arm_tools_missing() is not None, reason=str(runner.arm_tools_missing()))
@pytest.mark.usefixtures("prebuilt")
@pytest.mark.parametrize("check", runner.checks(), ids=lambda c: c.name)
def test_the_neon_build_gives_the_scalar_bits_under_qemu(check: runner.Check, tmp_path: Path) -> None:
    result = runner.run_check(check, "neon", tmp_path, cxx=runner.ARM_CXX)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 different" in result.stdout
