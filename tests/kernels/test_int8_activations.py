"""``--activations int8``: the native integer-product kernels with the activations as 8-bit integers per block
of 32 (llama.cpp's Q8_0 activations: d = max|x| / 127, q = round(x / d), ties to even). The product is held
bit for bit to a plain numpy reference built from the same quantized activations: exact integer sums per
block, then the kernels' documented float32 fold (per block, in order along K: acc = fma(sum q a, d_w * d_x,
acc), then acc = fma(m_w, d_x * sum a, acc)). Every instruction set's build gives these bits too
(tests/native/check_vnni_gemm.cpp, test_instruction_sets.py, test_arm64.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from gguf import quants as gguf_quants

from tests.engine.test_gguf_loader import random_blocks
from tokenmill_service.worker.kernels.cpu import kquant_gemm, vnni_gemm

pytestmark = pytest.mark.skipif(
    vnni_gemm.unavailable_reason() is not None, reason=f"VNNI kernel: {vnni_gemm.unavailable_reason()}"
)
F32, F64 = np.float32, np.float64


def _fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """float32 a * b + c rounded once (numpy has no fma): a * b is exact in float64, TwoSum gives the sum's
    exact remainder, and rounding the float64 sum to odd before float32 makes the second rounding the only one
    (float64 keeps more than 24 + 2 bits)."""
    p = a.astype(F64) * b.astype(F64)
    c64 = c.astype(F64)
    s = p + c64
    bp = s - c64
    err = (p - bp) + (c64 - (s - bp))
    even = (s.view(np.int64) & 1) == 0
    nudged = np.nextafter(s, np.where(err > 0, np.inf, -np.inf))
    return np.where((err != 0) & even, nudged, s).astype(F32)


def _quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's Q8_0 activations, as the kernel computes them in float32: int8 [m, k], d [m, k / 32]."""
    blocks = x.astype(F32).reshape(x.shape[0], -1, 32)
    d = (np.abs(blocks).max(-1) / F32(127)).astype(F32)
    inv = np.where(d != 0, F32(1) / np.where(d != 0, d, F32(1)), F32(0)).astype(F32)
    q = np.rint((blocks * inv[..., None]).astype(F32)).astype(np.int8)
    return q.reshape(x.shape), d


def _weights(raw: np.ndarray, qtype: QType) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """GGUF blocks [n, k / 32, bytes] as the kernel multiplies them, w = d * q + m with unsigned q:
    q int64 [n, k / 32, 32], d and m float32 [n, k / 32] (Q4_0's m = -8 d, Q8_0's -128 d: q = stored + 128)."""
    d = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(F32)
    if qtype == QType.Q8_0:
        q = raw[..., 2:34].view(np.int8).astype(np.int64) + 128
        return q, d, (d * F32(-128)).astype(F32)
    qs = raw[..., 4:20] if qtype == QType.Q4_1 else raw[..., 2:18]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int64)
    m = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(F32) if qtype == QType.Q4_1 else d * F32(-8)
    return q, d, m.astype(F32)


def _reference(x: np.ndarray, raw: np.ndarray, qtype: QType) -> np.ndarray:
    a, dx = _quantize(x)
    q, d, m = _weights(raw, qtype)
    rows, blocks = x.shape[0], x.shape[1] // 32
    a = a.reshape(rows, blocks, 32).astype(np.int64)
    acc = np.zeros((rows, q.shape[0]), dtype=F32)
    for b in range(blocks):
        isum = (a[:, None, b, :] * q[None, :, b, :]).sum(-1)  # exact
        scale = (d[None, :, b] * dx[:, b, None]).astype(F32)
        sx = (dx[:, b] * a[:, b, :].sum(-1).astype(F32)).astype(F32)
        acc = _fma32(isum.astype(F32), scale, acc)
        acc = _fma32(np.broadcast_to(m[None, :, b], acc.shape), np.broadcast_to(sx[:, None], acc.shape), acc)
    return acc


def _activations(m: int, k: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((m, k)).astype(F32)
    x[0, :32] *= F32(1e-30)  # a tiny block
    x[-1, 32:64] = 0  # an all-zero block
    x[m // 2, 70] = F32(50)  # an outlier: its block's unit is coarse
    return x


def test_the_activations_are_llama_cpps_q8_0() -> None:
    x = _activations(5, 256, 1)
    q, d = vnni_gemm.quantize_int8(torch.from_numpy(x))
    want_q, want_d = _quantize(x)
    assert np.array_equal(q.numpy(), want_q) and np.array_equal(d.numpy(), want_d)
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127 and d[-1, 1] == 0
    # Half a unit from rounding: 1/254 of the block's largest value.
    error = np.abs(q.numpy().reshape(5, -1, 32) * d.numpy()[..., None].astype(F64) - x.reshape(5, -1, 32))
    assert (error <= d.numpy()[..., None] * (0.5 + 1e-6)).all()


@pytest.mark.parametrize("qtype", [QType.Q4_0, QType.Q4_1, QType.Q8_0], ids=lambda t: t.name)
def test_the_product_is_the_exact_integer_sums_folded_in_the_documented_order(qtype: QType) -> None:
    n, k = 37, 320
    raw = random_blocks(qtype, n, k, np.random.default_rng(int(qtype)), 0.02).reshape(n, k // 32, -1)
    packed = vnni_gemm.pack(torch.from_numpy(raw), int(qtype))
    x = _activations(17, k, int(qtype) + 1)
    want = _reference(x, raw, qtype)
    full = vnni_gemm.vnni_gemm(torch.from_numpy(x), packed, int(qtype), n, int8=True)
    assert np.array_equal(full.numpy(), want)
    # A row's bits do not depend on the other rows (the tiles change past 4 and 8 rows) nor the threads.
    for rows in (1, 2, 3, 4, 5, 6, 7, 8, 13):
        part = vnni_gemm.vnni_gemm(torch.from_numpy(x[-rows:]), packed, int(qtype), n, int8=True)
        assert torch.equal(part, full[-rows:]), rows
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(vnni_gemm.vnni_gemm(torch.from_numpy(x), packed, int(qtype), n, int8=True), full)
    finally:
        torch.set_num_threads(threads)
    # The default keeps the 16-bit activations: closer to the float32 product than int8.
    weight = vnni_gemm.unpack(packed, int(qtype), n, k).double()
    exact = torch.from_numpy(x).double() @ weight.t()
    sixteen = vnni_gemm.vnni_gemm(torch.from_numpy(x), packed, int(qtype), n)
    assert (sixteen.double() - exact).abs().max() < (full.double() - exact).abs().max()


def _kquant_weights(raw: np.ndarray, qtype: QType) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """k-quant super-blocks [n, k / 256, bytes] as the kernel multiplies them: q int64 [n, k / 32, 32] (Q6_K:
    q - 32), and per block of 32 (Q6_K: per half block, [n, k / 16]) the exact scale d * sc and (Q4_K, Q5_K)
    minimum dmin * m. The integers come from gguf's own dequantization of the blocks with d = 1 and every
    scale 1 (Q4_K, Q5_K: minimums 0)."""
    n, supers = raw.shape[:2]
    flat = raw.reshape(n * supers, -1)
    unit = flat.copy()
    if qtype == QType.Q6_K:  # ql[128] qh[64] scales[16] (int8) d
        sc = flat[:, 192:208].view(np.int8).astype(F32)
        d = flat[:, 208:210].copy().view(np.float16).astype(F32)
        unit[:, 192:208] = 1
        unit[:, 208:210] = np.array([1.0], dtype=np.float16).view(np.uint8)
        q = gguf_quants.dequantize(unit, qtype).astype(np.int64)
        return q.reshape(n, -1, 32), (d * sc).reshape(n, -1).astype(F32), np.zeros(0, F32)
    # Q4_K, Q5_K: d dmin scales[12] ...
    d = flat[:, 0:2].copy().view(np.float16).astype(F32)
    dmin = flat[:, 2:4].copy().view(np.float16).astype(F32)
    sc, m = gguf_quants.Q4_K.get_scale_min(flat[:, 4:16])
    unit[:, 0:4] = np.array([1.0, 0.0], dtype=np.float16).view(np.uint8)
    unit[:, 4:8], unit[:, 8:12], unit[:, 12:16] = 1, 0, 1  # sc 0-3, m 0-3 (and high bits), low bits of 4-7
    q = gguf_quants.dequantize(unit, qtype).astype(np.int64)
    return q.reshape(n, -1, 32), (d * sc.astype(F32)).reshape(n, -1), (dmin * m.astype(F32)).reshape(n, -1)


def _kquant_reference(x: np.ndarray, raw: np.ndarray, qtype: QType) -> np.ndarray:
    a, dx = _quantize(x)
    q, de, dm = _kquant_weights(raw, qtype)
    rows, blocks = x.shape[0], x.shape[1] // 32
    a = a.reshape(rows, blocks, 32).astype(np.int64)
    acc = np.zeros((rows, q.shape[0]), dtype=F32)
    for b in range(blocks):
        prod = a[:, None, b, :] * q[None, :, b, :]
        if qtype == QType.Q6_K:  # per half block: its own scale, the sum of (q - 32) a
            for h in range(2):
                scale = (de[None, :, 2 * b + h] * dx[:, b, None]).astype(F32)
                acc = _fma32(prod[..., 16 * h : 16 * h + 16].sum(-1).astype(F32), scale, acc)
            continue
        scale = (de[None, :, b] * dx[:, b, None]).astype(F32)
        sx = (dx[:, b] * a[:, b, :].sum(-1).astype(F32)).astype(F32)
        acc = _fma32(prod.sum(-1).astype(F32), scale, acc)
        acc = _fma32(np.broadcast_to(-dm[None, :, b], acc.shape), np.broadcast_to(sx[:, None], acc.shape), acc)
    return acc


@pytest.mark.parametrize("qtype", [QType.Q4_K, QType.Q5_K, QType.Q6_K], ids=lambda t: t.name)
def test_the_kquant_product_is_the_exact_integer_sums_folded_in_the_documented_order(qtype: QType) -> None:
    n, k = 37, 512
    raw = random_blocks(qtype, n, k, np.random.default_rng(int(qtype)), 0.02).reshape(n, k // 256, -1)
    packed = kquant_gemm.pack(torch.from_numpy(raw), int(qtype))
    x = _activations(17, k, int(qtype) + 1)
    full = kquant_gemm.kquant_gemm(torch.from_numpy(x), packed, int(qtype), n, int8=True)
    assert np.array_equal(full.numpy(), _kquant_reference(x, raw, qtype))
    for rows in (1, 2, 3, 4, 5, 6, 7, 8, 13):
        part = kquant_gemm.kquant_gemm(torch.from_numpy(x[-rows:]), packed, int(qtype), n, int8=True)
        assert torch.equal(part, full[-rows:]), rows


KQUANTS = [QType.Q4_K, QType.Q5_K, QType.Q6_K, QType.Q2_K, QType.Q3_K, QType.IQ4_XS]


@pytest.mark.parametrize("qtype", KQUANTS, ids=lambda t: t.name)
def test_every_kquant_multiplies_the_dequantized_weights_by_the_q8_0_activations(qtype: QType) -> None:
    """Each k-quant's 8-bit product is the float64 product of its dequantized weights and the activations as
    rounded (Q8_0, a unit a block of 32) to float32's rounding: every format's scales, minimums and offsets (Q2_K,
    Q3_K and IQ4_XS included, which the exact reference above does not build) are folded right."""
    n, k = 45, 512
    raw = random_blocks(qtype, n, k, np.random.default_rng(int(qtype) + 7), 0.02).reshape(n, k // 256, -1)
    packed = kquant_gemm.pack(torch.from_numpy(raw), int(qtype))
    x = _activations(9, k, int(qtype) + 3)
    a, dx = _quantize(x)
    xq = (a.reshape(9, -1, 32).astype(F64) * dx[..., None]).reshape(9, k)
    weight = kquant_gemm.unpack(packed, int(qtype), n, k).double().numpy()
    got = kquant_gemm.kquant_gemm(torch.from_numpy(x), packed, int(qtype), n, int8=True).double().numpy()
    bound = 1e-5 * (np.abs(xq) @ np.abs(weight).T)
    assert (np.abs(got - xq @ weight.T) <= bound).all()
    # Against the unrounded activations the product is off by far more: the test sees the rounding.
    assert not (np.abs(got - x.astype(F64) @ weight.T) <= bound).all()
