"""Triton's interpreter runs worker/kernels/triton/interpreter.py's ``tl.dot``: an element of a product is
bitwise the same wherever its row lies in the tile and whatever the other rows hold, as on a GPU, and
also where NumPy's BLAS would make it otherwise (OpenBLAS's AVX2 kernels, on an AVX2-only CPU: the
batch-invariance tests of the triton attention kernels failed there until the interpreter had this dot)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.triton_setup import DEVICE
from tokenmill_service.worker.kernels.triton import interpreter

import triton  # isort: skip  (after tests.triton_setup, which switches the interpreter on)
import triton.language as tl  # isort: skip

pytestmark = pytest.mark.skipif(DEVICE.type != "cpu", reason="the interpreter's dot (no GPU here)")

ROOT = Path(__file__).parents[2]
ROWS = 16  # the attention kernels' tile rows


@triton.jit  # type: ignore[untyped-decorator]
def _dot_kernel(a_ptr, b_ptr, out_ptr, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr, B_T: tl.constexpr):  # type: ignore[no-untyped-def]
    m = tl.arange(0, M)
    k = tl.arange(0, K)
    n = tl.arange(0, N)
    a = tl.load(a_ptr + m[:, None] * K + k[None, :])
    if B_T:  # b stored [N, K] and transposed in the kernel, as the attention kernels read keys
        b = tl.trans(tl.load(b_ptr + n[:, None] * K + k[None, :]))
    else:
        b = tl.load(b_ptr + k[:, None] * N + n[None, :])
    tl.store(out_ptr + m[:, None] * N + n[None, :], tl.dot(a, b, input_precision="ieee"))


def dot(a: torch.Tensor, b: torch.Tensor, b_transposed: bool) -> torch.Tensor:
    m, k = a.shape
    n = b.shape[0] if b_transposed else b.shape[1]
    out = torch.empty(m, n)
    _dot_kernel[(1,)](a, b, out, M=m, K=k, N=n, B_T=b_transposed)
    return out


def test_the_interpreter_runs_tokenmills_dot() -> None:
    assert interpreter.installed()


@pytest.mark.parametrize(("k", "n"), [(64, 64), (16, 64), (128, 32)])
@pytest.mark.parametrize("b_transposed", [False, True])
def test_a_row_of_a_dot_is_bitwise_the_same_in_every_place_of_its_tile(k: int, n: int, b_transposed: bool) -> None:
    gen = torch.Generator().manual_seed(k * n)
    b = torch.randn((n, k) if b_transposed else (k, n), generator=gen)
    row = torch.randn(k, generator=gen)
    got = set()
    for place in range(ROWS):
        a = torch.randn(ROWS, k, generator=gen)
        a[place] = row
        got.add(dot(a, b, b_transposed)[place].numpy().tobytes())
    assert len(got) == 1


@pytest.mark.parametrize(("batch", "m", "k", "n"), [((), 16, 64, 64), ((), 16, 1, 8), ((), 16, 7, 5), ((3,), 4, 33, 9)])
def test_the_elementwise_dot_is_a_product(batch: tuple[int, ...], m: int, k: int, n: int) -> None:
    rng = np.random.default_rng(k)
    a = rng.standard_normal((*batch, m, k)).astype(np.float32)
    b = rng.standard_normal((*batch, k, n)).astype(np.float32)
    got = interpreter.elementwise_dot(a, b, np.float32)
    assert got.dtype == np.float32 and got.shape == (*batch, m, n)
    np.testing.assert_allclose(got, a.astype(np.float64) @ b.astype(np.float64), rtol=1e-5, atol=1e-5)


def test_a_dot_over_nothing_is_zeros() -> None:
    got = interpreter.elementwise_dot(np.ones((4, 0), np.float32), np.ones((0, 3), np.float32), np.float32)
    assert got.shape == (4, 3) and not got.any()


def test_the_rows_hold_under_openblas_avx2_kernels() -> None:
    """The row test again in a process whose OpenBLAS runs its AVX2 (Haswell) kernels, as on an AVX2-only
    CPU: there NumPy's matmul gives a row other bits in other places of a [16, K] tile, so this fails
    on any x86-64 CPU if the interpreter's dot is the BLAS's again."""
    env = {**os.environ, "OPENBLAS_CORETYPE": "Haswell", "TRITON_INTERPRET": "1"}
    code = (
        "from tests.kernels import test_triton_interpreter as t\n"
        "for b_t in (False, True): t.test_a_row_of_a_dot_is_bitwise_the_same_in_every_place_of_its_tile(64, 64, b_t)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
