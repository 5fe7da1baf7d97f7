"""Quantization methods behind the linear layers agree with their dequantized dense equivalents,
and GGUF Q4_0/Q4_1 tensors are served as stored (dequantizing exactly as gguf.quants does)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from gguf import quants

from tokenmill_service.worker.distributed.parallel import TensorParallel
from tokenmill_service.worker.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, ReplicatedLinear
from tokenmill_service.worker.layers.quant import quant_method_class
from tokenmill_service.worker.layers.quant.gguf_blocks import GGUFBlocks

SHAPES = [(64, 32), (96, 128), (576, 192)]  # (out, in)
BATCHES = [1, 2, 7, 16, 64]


def _layer(method: str, out: int, inp: int, act: torch.dtype, weight: torch.Tensor | GGUFBlocks) -> ReplicatedLinear:
    layer = ReplicatedLinear(inp, out, False, quant_method_class(method)(act))
    layer.load_weight(weight)
    layer.finalize()
    return layer


def _gguf(weight: torch.Tensor, qtype: QType) -> GGUFBlocks:
    raw = quants.quantize(weight.numpy(), qtype)
    return GGUFBlocks.from_raw(raw, qtype, tuple(weight.shape))  # type: ignore[arg-type]


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize(("out", "inp"), SHAPES)
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_quantized_linear_matches_its_dequantized_weight(method: str, out: int, inp: int, act: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(out + inp)
    weight = torch.randn(out, inp, generator=gen) * 0.05
    layer = _layer(method, out, inp, act, weight)
    dense = layer.quant.dequantized(layer)
    # The quantization itself is close to the float weight...
    assert (dense - weight).abs().max() <= (0.05 * 4 / 127 if method == "int8" else weight.abs().max() / 7)
    # ...and the product is the dense product with the dequantized weight, to bfloat16's precision: the
    # CPU kernels run in bfloat16 (float32 activations as two bfloat16 halves), scales included.
    tol = 1e-2
    for m in BATCHES:
        x = torch.randn(m, inp, generator=gen)
        got = layer(x.to(act)).float()
        want = x.to(act).float() @ dense.t()
        assert (got - want).abs().max() <= tol * want.abs().max().clamp(min=1), (m, (got - want).abs().max())


@pytest.mark.parametrize("qtype", [QType.Q4_0, QType.Q4_1])
def test_gguf_4bit_tensors_are_served_as_stored_and_dequantize_exactly(qtype: QType) -> None:
    weight = torch.randn(96, 128, generator=torch.Generator().manual_seed(3))
    blocks = _gguf(weight, qtype)
    layer = _layer("int4", 96, 128, torch.float32, blocks)
    expected = torch.from_numpy(quants.dequantize(quants.quantize(weight.numpy(), qtype), qtype).astype(np.float32))
    assert torch.equal(layer.quant.dequantized(layer), expected)
    assert torch.equal(blocks.dequantize(), expected)
    # The product follows the stored weight (no re-quantization on the way; bfloat16 kernel scales).
    x = torch.randn(5, 128)
    want = x @ expected.t()
    assert (layer(x) - want).abs().max() <= 1e-2 * want.abs().max()


def test_dense_layer_is_exact_in_float32() -> None:
    weight = torch.randn(40, 300)
    layer = _layer("none", 40, 300, torch.float32, weight)
    x = torch.randn(3, 300)
    torch.testing.assert_close(layer(x), x @ weight.t(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("method", ["none", "int8", "int4"])
def test_a_rows_result_does_not_depend_on_the_other_rows(method: str) -> None:
    """Batch invariance of every method: row i of a product is bit-identical whatever rows surround it."""
    weight = torch.randn(192, 576, generator=torch.Generator().manual_seed(5)) * 0.05
    layer = _layer(method, 192, 576, torch.float32, weight)
    x = torch.randn(65, 576, generator=torch.Generator().manual_seed(6))
    full = layer(x)
    for m in (1, 2, 3, 16, 17, 64):
        assert torch.equal(layer(x[:m]), full[:m]), m
    assert torch.equal(layer(x[40:41]), full[40:41])


@pytest.mark.parametrize("method", ["none", "int4"])
def test_packed_qkv_and_gate_up_equal_the_separate_projections(method: str) -> None:
    gen = torch.Generator().manual_seed(7)
    hidden, head_dim, heads, kv_heads = 64, 16, 4, 2
    q, k, v = (torch.randn(n * head_dim, hidden, generator=gen) for n in (heads, kv_heads, kv_heads))
    qkv = QKVParallelLinear(
        hidden, head_dim, heads, kv_heads, False, quant_method_class(method)(torch.float32), TensorParallel()
    )
    for shard, w in zip("qkv", (q, k, v)):
        qkv.load_weight(w, shard)
    qkv.finalize()
    gate, up = torch.randn(96, hidden, generator=gen), torch.randn(96, hidden, generator=gen)
    gate_up = MergedColumnParallelLinear(
        hidden, [96, 96], False, quant_method_class(method)(torch.float32), TensorParallel()
    )
    gate_up.load_weight(up, 1)  # pieces may arrive in any order
    gate_up.load_weight(gate, 0)
    gate_up.finalize()
    x = torch.randn(9, hidden, generator=gen)
    for layer, parts in ((qkv, (q, k, v)), (gate_up, (gate, up))):
        separate = torch.cat([_layer(method, w.shape[0], hidden, torch.float32, w)(x) for w in parts], dim=-1)
        torch.testing.assert_close(layer(x), separate, atol=1e-5, rtol=1e-5)
