"""``--quantization gguf`` and ``gguf-vnni``: GGUF blocks multiplied as stored by tokenmill's native
CPU kernels (worker/kernels/cpu/block_gemm.cpp: float32 activations; worker/kernels/cpu/vnni_gemm.cpp: 16-bit fixed-point
activations, integer products), checked against the plain-torch product with gguf's own
dequantization."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from gguf import quants

from tests.engine.test_gguf_loader import random_blocks
from tokenmill_service.worker.distributed.parallel import TensorParallel
from tokenmill_service.worker.kernels.cpu import block_gemm, vnni_gemm
from tokenmill_service.worker.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, ReplicatedLinear
from tokenmill_service.worker.layers.quant import quant_method_class
from tokenmill_service.worker.layers.quant.fp8_tensor import FP8_DTYPE, Fp8Blocks
from tokenmill_service.worker.layers.quant.gguf_blocks import GGUFBlocks

pytestmark = pytest.mark.skipif(
    block_gemm.unavailable_reason() is not None, reason=f"native kernel unavailable: {block_gemm.unavailable_reason()}"
)
QTYPES = [QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1, QType.Q8_0, QType.IQ4_NL, QType.MXFP4]
METHODS = [
    "gguf",
    pytest.param(
        "gguf-vnni",
        marks=pytest.mark.skipif(
            vnni_gemm.unavailable_reason() is not None, reason=f"VNNI kernel: {vnni_gemm.unavailable_reason()}"
        ),
    ),
]


def _blocks(weight: torch.Tensor, qtype: QType) -> GGUFBlocks:
    if qtype == QType.IQ4_NL:  # gguf cannot quantize to it: random valid blocks of about the weight's size
        rng = np.random.default_rng(weight.shape[0] * weight.shape[1])
        scale = weight.abs().max().item() / 127
        raw = random_blocks(qtype, weight.shape[0], weight.shape[1], rng, scale)
    else:
        raw = quants.quantize(weight.numpy(), qtype)
    return GGUFBlocks.from_raw(raw, qtype, (weight.shape[0], weight.shape[1]))


def _layer(blocks: GGUFBlocks, act: torch.dtype = torch.float32, method: str = "gguf") -> ReplicatedLinear:
    out, inp = blocks.shape
    layer = ReplicatedLinear(inp, out, False, quant_method_class(method)(act))
    layer.load_weight(blocks)
    layer.finalize()
    return layer


def _gguf_dequantized(blocks: GGUFBlocks) -> torch.Tensor:
    raw = blocks.data.numpy().reshape(blocks.shape[0], -1)
    return torch.from_numpy(quants.dequantize(raw, blocks.qtype).astype(np.float32))


def _as_multiplied(x: torch.Tensor, method: str) -> torch.Tensor:
    """The activations as the kernel multiplies them, in float64."""
    if method == "gguf":
        return x.double()
    q, unit = vnni_gemm.quantize(x)
    return (q.double().view(x.shape[0], -1, 32) * unit.double()[..., None]).view(x.shape)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize(("out", "inp"), [(64, 32), (97, 128), (576, 1536)])
def test_the_product_is_the_float32_product_with_ggufs_dequantized_weight(
    method: str, qtype: QType, out: int, inp: int
) -> None:
    gen = torch.Generator().manual_seed(out + inp)
    blocks = _blocks(torch.randn(out, inp, generator=gen) * 0.05, qtype)
    layer = _layer(blocks, method=method)
    weight = _gguf_dequantized(blocks)
    # The kernel multiplies by exactly the weights gguf dequantizes to...
    assert torch.equal(layer.quant.dequantized(layer), weight)
    for m in (1, 2, 3, 4, 5, 6, 7, 64, 131):
        x = torch.randn(m, inp, generator=gen)
        got = layer(x)
        want = (_as_multiplied(x, method) @ weight.double().t()).float()
        # ...with float32 sums (and scales): only their order and rounding differ from float64's.
        torch.testing.assert_close(got, want, atol=1e-5 * want.abs().max().item(), rtol=1e-5)
    # Packed or not, a row takes as many bytes as in the file (VNNI: in groups of 16 rows; MXFP4's scale as
    # float16, a byte a block more).
    rows = out if method == "gguf" else -(-out // 16) * 16
    extra = inp // 32 if (method, qtype) == ("gguf-vnni", QType.MXFP4) else 0
    assert layer.quant.weight_bytes(layer) == rows * (blocks.data[0].numel() + extra)


def test_vnni_activations_are_16_bit_fixed_point_per_block_of_32() -> None:
    if vnni_gemm.unavailable_reason() is not None:
        pytest.skip(f"VNNI kernel: {vnni_gemm.unavailable_reason()}")
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(7, 256, generator=gen) * torch.logspace(-6, 3, 7)[:, None]
    x[0, :32] = 0.0  # an all-zero block
    x[1, 5] = 1e4  # an outlier: only its own block's resolution suffers
    q, unit = vnni_gemm.quantize(x)
    blocks = x.view(7, -1, 32)
    amax = blocks.abs().amax(-1)
    torch.testing.assert_close(unit, amax / 127 / 256, rtol=1e-6, atol=0)
    error = (q.double().view(7, -1, 32) * unit.double()[..., None] - blocks.double()).abs()
    # Half a unit from rounding the low digit (a full one where it saturates at 127), so about
    # 2**-16 of the block's largest value.
    assert (error <= unit.double()[..., None] * (1 + 1e-6)).all()
    assert q[0, :32].eq(0).all() and unit[0, 0] == 0
    assert q.abs().max() <= 127 * 256 + 127


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("qtype", QTYPES)
def test_a_rows_result_does_not_depend_on_the_other_rows_or_the_thread_count(method: str, qtype: QType) -> None:
    blocks = _blocks(torch.randn(200, 576, generator=torch.Generator().manual_seed(5)) * 0.05, qtype)
    layer = _layer(blocks, method=method)
    x = torch.randn(300, 576, generator=torch.Generator().manual_seed(6))
    _rows_are_independent_of_the_batch_and_the_thread_count(layer, x)


def _rows_are_independent_of_the_batch_and_the_thread_count(layer: ReplicatedLinear, x: torch.Tensor) -> None:
    full = layer(x)
    for m in (1, 2, 3, 4, 5, 6, 7, 13, 64, 200):
        assert torch.equal(layer(x[:m]), full[:m]), m
    for row in (0, 41, 299):
        assert torch.equal(layer(x[row : row + 1]), full[row : row + 1]), row
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(layer(x), full)
    finally:
        torch.set_num_threads(threads)


def test_dense_float32_rows_take_the_same_fixed_order() -> None:
    """--quantization none in float32: the weight's rows through the kernel's F32 format, so a row's
    result does not depend on its batch on any AVX-512 CPU (MKL's own product's does, on AMD's)."""
    gen = torch.Generator().manual_seed(9)
    weight = torch.randn(200, 576, generator=gen) * 0.05
    layer = ReplicatedLinear(576, 200, False, quant_method_class("none")(torch.float32))
    layer.load_weight(weight)
    layer.finalize()
    assert layer.quant.native_kernel == ("block_gemm", "tm_block_gemm")
    assert torch.equal(layer.quant.dequantized(layer), weight)
    x = torch.randn(300, 576, generator=gen)
    want = (x.double() @ weight.double().t()).float()
    torch.testing.assert_close(layer(x), want, atol=1e-5 * want.abs().max().item(), rtol=1e-5)
    _rows_are_independent_of_the_batch_and_the_thread_count(layer, x)


@pytest.mark.parametrize("method", METHODS)
def test_packed_qkv_and_gate_up_equal_the_separate_projections(method: str) -> None:
    gen = torch.Generator().manual_seed(7)
    hidden, head_dim, heads, kv_heads = 64, 16, 4, 2
    q, k, v = (_blocks(torch.randn(n * head_dim, hidden, generator=gen), QType.Q4_1) for n in (heads, kv_heads, 2))
    qkv = QKVParallelLinear(
        hidden, head_dim, heads, kv_heads, False, quant_method_class(method)(torch.float32), TensorParallel()
    )
    for shard, w in zip("qkv", (q, k, v)):
        qkv.load_weight(w, shard)
    qkv.finalize()
    gate, up = (_blocks(torch.randn(96, hidden, generator=gen), QType.Q4_1) for _ in range(2))
    gate_up = MergedColumnParallelLinear(
        hidden, [96, 96], False, quant_method_class(method)(torch.float32), TensorParallel()
    )
    gate_up.load_weight(up, 1)  # pieces may arrive in any order
    gate_up.load_weight(gate, 0)
    gate_up.finalize()
    x = torch.randn(9, hidden, generator=gen)
    for layer, parts in ((qkv, (q, k, v)), (gate_up, (gate, up))):
        assert torch.equal(layer(x), torch.cat([_layer(w, method=method)(x) for w in parts], dim=-1))


@pytest.mark.parametrize("method", METHODS)
def test_bfloat16_activations_are_multiplied_as_float32_and_returned_in_bfloat16(method: str) -> None:
    blocks = _blocks(torch.randn(64, 128, generator=torch.Generator().manual_seed(8)), QType.Q4_1)
    x = torch.randn(3, 128).to(torch.bfloat16)
    got = _layer(blocks, torch.bfloat16, method)(x)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, _layer(blocks, method=method)(x.float()).to(torch.bfloat16))


@pytest.mark.parametrize("method", METHODS)
def test_tensors_it_cannot_serve_as_stored_are_refused_clearly(method: str) -> None:
    layer = ReplicatedLinear(64, 32, False, quant_method_class(method)(torch.float32))
    with pytest.raises(
        ValueError,
        match="serves IQ4_NL, MXFP4, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 tensors as stored, not a torch.float32 tensor",
    ):
        layer.load_weight(torch.randn(32, 64))
    # Once an AttributeError (the message read a dtype that FP8 block-scaled tensors do not have).
    fp8 = Fp8Blocks(torch.zeros(32, 64).to(FP8_DTYPE), torch.ones(1, 2), (32, 32))
    with pytest.raises(ValueError, match="as stored, not an FP8 block-scaled tensor"):
        layer.load_weight(fp8)
    mixed = QKVParallelLinear(64, 16, 2, 1, False, quant_method_class(method)(torch.float32), TensorParallel())
    mixed.load_weight(_blocks(torch.randn(32, 64), QType.Q4_1), "q")
    with pytest.raises(ValueError, match="stored as both Q4_1 and Q8_0"):
        mixed.load_weight(_blocks(torch.randn(16, 64), QType.Q8_0), "k")


def test_without_a_compiler_the_kernels_say_why_and_auto_serves_with_torchs(tmp_path: Path) -> None:
    """A fresh process with no C++ compiler and an empty kernel cache: ``auto`` falls back to torch's
    kernels (every layer dense float32, the reference attention), logging why, and warning once a process
    what is missing and what to install."""
    code = (
        "from tokenmill_service.worker.kernels.cpu import block_gemm\n"
        "from tokenmill_service.worker.loader import load_model, resolve_model_path\n"
        "print('REASON', block_gemm.unavailable_reason())\n"
        "print('QUANT', load_model(resolve_model_path(None), quantization='auto').quantization)\n"
        "load_model(resolve_model_path(None), quantization='auto')  # a second model: no second warning\n"
    )
    env = {
        "CXX": "/nonexistent/g++",
        "TOKENMILL_KERNEL_CACHE": str(tmp_path),
        "XDG_CACHE_HOME": str(tmp_path),
        "TMPDIR": str(tmp_path),
    }
    result = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "REASON no C++ compiler (/nonexistent/g++) on PATH" in result.stdout
    assert "QUANT none" in result.stdout
    logs = result.stdout + result.stderr
    assert "native_kernel_skipped" in logs and "'gguf-vnni': 'no C++ compiler" in logs
    assert logs.count("native_kernels_unavailable") == 1 and "apt-get install g++" in logs
    assert "attention=torch" in logs
