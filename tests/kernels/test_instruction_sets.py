"""The same bits on every CPU: each kernel built for an instruction set gives exactly the scalar build's
outputs (tests/native/check_*.cpp, one program a kernel, every exported function on shared inputs), and
simd.h's ops, edge values included, do too. This machine checks every instruction set it runs; the ARM64
builds are checked under qemu (test_arm64.py, ``make test-arm``)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.native import runner
from tokenmill_service.contract.plan import cpu_isa

VECTOR_ISAS = [s.name for s in cpu_isa.INSTRUCTION_SETS if s.name != "scalar"]


@pytest.fixture(scope="module")
def prebuilt() -> None:
    """Every library the checks below load, built ahead on both cores (cached as the server's kernels are)."""
    if shutil.which("g++") is not None:
        runner.wait_for_the_other_builds()
        runner.build_all([(c, isa) for c in runner.checks() for isa in VECTOR_ISAS if cpu_isa.missing(isa) is None])


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
@pytest.mark.usefixtures("prebuilt")
@pytest.mark.parametrize("isa", VECTOR_ISAS)
@pytest.mark.parametrize("check", runner.checks(), ids=lambda c: c.name)
def test_every_instruction_set_gives_the_scalar_bits(check: runner.Check, isa: str, tmp_path: Path) -> None:
    if (why := cpu_isa.missing(isa)) is not None:
        pytest.skip(f"the {isa} build cannot run here: {why}")
    result = runner.run_check(check, isa, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 different" in result.stdout


def test_auto_takes_the_fastest_instruction_set_the_cpu_runs() -> None:
    zen4 = frozenset({"avx2", "fma", "f16c", "bmi2", "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni"})
    zen3 = frozenset({"avx2", "fma", "f16c", "bmi2"})
    graviton = frozenset({"asimd", "asimddp", "fphp", "asimdhp"})
    assert cpu_isa.choose("auto", zen4, "x86_64").name == "avx512"
    assert cpu_isa.choose("auto", zen3, "x86_64").name == "avx2"
    # Intel's cores since Alder Lake without AVX-512 (and its E-core Xeons): AVX2 with AVX-VNNI's products.
    assert cpu_isa.choose("auto", zen3 | {"avx_vnni"}, "x86_64").name == "avx2vnni"
    assert cpu_isa.choose("auto", zen4 | {"avx_vnni"}, "x86_64").name == "avx512"
    assert cpu_isa.choose("auto", graviton, "aarch64").name == "neon"
    # Skylake-X without VNNI, an old ARM core without the dot product: what they have is not enough.
    assert cpu_isa.choose("auto", zen4 - {"avx512_vnni"}, "x86_64").name == "avx2"
    plain = cpu_isa.choose("auto", frozenset({"asimd"}), "aarch64")
    assert plain.name == "scalar" and "slower" in plain.reason


def test_an_instruction_set_the_cpu_lacks_is_refused_naming_what_is_missing() -> None:
    zen3 = frozenset({"avx2", "fma", "f16c", "bmi2"})
    with pytest.raises(ValueError, match="--cpu-isa avx512 cannot run here: this CPU lacks avx512_vnni"):
        cpu_isa.choose("avx512", zen3 | {"avx512f", "avx512bw", "avx512dq", "avx512vl"}, "x86_64")
    with pytest.raises(ValueError, match="neon is for aarch64 CPUs and this one is x86_64"):
        cpu_isa.choose("neon", zen3, "x86_64")
    with pytest.raises(ValueError, match="--cpu-isa must be one of auto, scalar, neon, avx2, avx2vnni, avx512"):
        cpu_isa.choose("sse2")
    assert cpu_isa.choose("scalar", frozenset(), "riscv64").name == "scalar"
