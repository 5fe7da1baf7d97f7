"""``--quantization gguf``: GGUF blocks multiplied as stored by tokenmill's native CPU kernel
(layers/quant/block_gemm.cpp), checked against the plain-torch product with gguf's own dequantization."""

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

from tokenmill_service.distributed.parallel import TensorParallel
from tokenmill_service.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, ReplicatedLinear
from tokenmill_service.layers.quant import quant_method_class
from tokenmill_service.layers.quant.gguf_blocks import GGUFBlocks
from tokenmill_service.native import block_gemm

pytestmark = pytest.mark.skipif(
    block_gemm.unavailable_reason() is not None, reason=f"native kernel unavailable: {block_gemm.unavailable_reason()}"
)
QTYPES = [QType.Q4_0, QType.Q4_1, QType.Q8_0]


def _blocks(weight: torch.Tensor, qtype: QType) -> GGUFBlocks:
    raw = quants.quantize(weight.numpy(), qtype)
    return GGUFBlocks.from_raw(raw, qtype, (weight.shape[0], weight.shape[1]))


def _layer(blocks: GGUFBlocks, act: torch.dtype = torch.float32) -> ReplicatedLinear:
    out, inp = blocks.shape
    layer = ReplicatedLinear(inp, out, False, quant_method_class("gguf")(act))
    layer.load_weight(blocks)
    layer.finalize()
    return layer


def _gguf_dequantized(blocks: GGUFBlocks) -> torch.Tensor:
    raw = blocks.data.numpy().reshape(blocks.shape[0], -1)
    return torch.from_numpy(quants.dequantize(raw, blocks.qtype).astype(np.float32))


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize(("out", "inp"), [(64, 32), (97, 128), (576, 1536)])
def test_the_product_is_the_float32_product_with_ggufs_dequantized_weight(qtype: QType, out: int, inp: int) -> None:
    gen = torch.Generator().manual_seed(out + inp)
    blocks = _blocks(torch.randn(out, inp, generator=gen) * 0.05, qtype)
    layer = _layer(blocks)
    weight = _gguf_dequantized(blocks)
    # The kernel multiplies by exactly the weights gguf dequantizes to...
    assert torch.equal(layer.quant.dequantized(layer), weight)
    for m in (1, 2, 5, 6, 7, 64, 131):
        x = torch.randn(m, inp, generator=gen)
        got = layer(x)
        want = (x.double() @ weight.double().t()).float()
        # ...in float32 throughout: only the order of the float32 sums differs from float64's.
        torch.testing.assert_close(got, want, atol=1e-5 * want.abs().max().item(), rtol=1e-5)
    assert layer.quant.weight_bytes(layer) == blocks.data.numel()


@pytest.mark.parametrize("qtype", QTYPES)
def test_a_rows_result_does_not_depend_on_the_other_rows_or_the_thread_count(qtype: QType) -> None:
    blocks = _blocks(torch.randn(200, 576, generator=torch.Generator().manual_seed(5)) * 0.05, qtype)
    layer = _layer(blocks)
    x = torch.randn(300, 576, generator=torch.Generator().manual_seed(6))
    full = layer(x)
    for m in (1, 2, 3, 5, 6, 7, 13, 64, 200):
        assert torch.equal(layer(x[:m]), full[:m]), m
    for row in (0, 41, 299):
        assert torch.equal(layer(x[row : row + 1]), full[row : row + 1]), row
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(layer(x), full)
    finally:
        torch.set_num_threads(threads)


def test_packed_qkv_and_gate_up_equal_the_separate_projections() -> None:
    gen = torch.Generator().manual_seed(7)
    hidden, head_dim, heads, kv_heads = 64, 16, 4, 2
    q, k, v = (_blocks(torch.randn(n * head_dim, hidden, generator=gen), QType.Q4_1) for n in (heads, kv_heads, 2))
    qkv = QKVParallelLinear(
        hidden, head_dim, heads, kv_heads, False, quant_method_class("gguf")(torch.float32), TensorParallel()
    )
    for shard, w in zip("qkv", (q, k, v)):
        qkv.load_weight(w, shard)
    gate, up = (_blocks(torch.randn(96, hidden, generator=gen), QType.Q4_1) for _ in range(2))
    gate_up = MergedColumnParallelLinear(
        hidden, [96, 96], False, quant_method_class("gguf")(torch.float32), TensorParallel()
    )
    gate_up.load_weight(up, 1)  # pieces may arrive in any order
    gate_up.load_weight(gate, 0)
    x = torch.randn(9, hidden, generator=gen)
    for layer, parts in ((qkv, (q, k, v)), (gate_up, (gate, up))):
        assert torch.equal(layer(x), torch.cat([_layer(w)(x) for w in parts], dim=-1))


def test_bfloat16_activations_are_multiplied_in_float32_and_returned_in_bfloat16() -> None:
    blocks = _blocks(torch.randn(64, 128, generator=torch.Generator().manual_seed(8)), QType.Q4_1)
    x = torch.randn(3, 128).to(torch.bfloat16)
    got = _layer(blocks, torch.bfloat16)(x)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, _layer(blocks)(x.float()).to(torch.bfloat16))


def test_tensors_it_cannot_serve_as_stored_are_refused_clearly() -> None:
    layer = ReplicatedLinear(64, 32, False, quant_method_class("gguf")(torch.float32))
    with pytest.raises(ValueError, match="serves Q4_0, Q4_1, Q8_0 tensors as stored, not a torch.float32 tensor"):
        layer.load_weight(torch.randn(32, 64))
    mixed = QKVParallelLinear(64, 16, 2, 1, False, quant_method_class("gguf")(torch.float32), TensorParallel())
    mixed.load_weight(_blocks(torch.randn(32, 64), QType.Q4_1), "q")
    with pytest.raises(ValueError, match="stored as both Q4_1 and Q8_0"):
        mixed.load_weight(_blocks(torch.randn(16, 64), QType.Q8_0), "k")


def test_without_a_compiler_the_kernels_say_why_and_auto_serves_with_torchs(tmp_path: Path) -> None:
    """A fresh process with no C++ compiler and an empty kernel cache: ``auto`` falls back to torch's
    kernels (int4 layers, a dense head, the reference attention), logging why."""
    code = (
        "from tokenmill_service.native import block_gemm\n"
        "from tokenmill_service.models.loader import load_model, resolve_model_path\n"
        "print('REASON', block_gemm.unavailable_reason())\n"
        "print('QUANT', load_model(resolve_model_path(None), quantization='auto').quantization)\n"
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
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "REASON no C++ compiler (/nonexistent/g++) on PATH" in result.stdout
    assert "QUANT int4+none" in result.stdout
    logs = result.stdout + result.stderr
    assert "native_kernel_skipped" in logs and "reason='no C++ compiler" in logs
    assert "attention=torch" in logs
