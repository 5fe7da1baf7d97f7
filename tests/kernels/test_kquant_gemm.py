"""``--quantization gguf-kquant``: llama.cpp's k-quants (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS) multiplied as stored by the native
kernel (worker/kernels/cpu/kquant_gemm.cpp: 16-bit fixed-point activations, integer products), checked against
gguf's own dequantization and the float64 product."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from gguf import quants

from tests.engine.test_gguf_loader import random_blocks
from tests.kernels.test_native_block_gemm import _rows_are_independent_of_the_batch_and_the_thread_count
from tokenmill_service.worker.distributed.parallel import TensorParallel
from tokenmill_service.worker.kernels.cpu import kquant_gemm, vnni_gemm
from tokenmill_service.worker.layers.linear import QKVParallelLinear, ReplicatedLinear
from tokenmill_service.worker.layers.quant import quant_method_class
from tokenmill_service.worker.layers.quant.gguf_blocks import GGUFBlocks

pytestmark = pytest.mark.skipif(
    kquant_gemm.unavailable_reason() is not None, reason=f"k-quant kernel: {kquant_gemm.unavailable_reason()}"
)
# Q3_K and IQ4_XS are read as Q6_K is (int8 scales per 16, an offset q): Q3_K's 2 low bits and high bit in
# planes, IQ4_XS's indices looked up.
QTYPES = [QType.Q4_K, QType.Q5_K, QType.Q6_K, QType.Q3_K, QType.IQ4_XS, QType.Q2_K]


def _blocks(qtype: QType, out: int, inp: int, seed: int) -> GGUFBlocks:
    raw = random_blocks(qtype, out, inp, np.random.default_rng(seed), scale=0.01)
    return GGUFBlocks.from_raw(raw, qtype, (out, inp))


def _layer(blocks: GGUFBlocks) -> ReplicatedLinear:
    out, inp = blocks.shape
    layer = ReplicatedLinear(inp, out, False, quant_method_class("gguf-kquant")(torch.float32))
    layer.load_weight(blocks)
    layer.finalize()
    return layer


def _gguf_dequantized(blocks: GGUFBlocks) -> torch.Tensor:
    raw = blocks.data.numpy().reshape(blocks.shape[0], -1)
    return torch.from_numpy(quants.dequantize(raw, blocks.qtype).astype(np.float32))


def _as_multiplied(x: torch.Tensor) -> torch.Tensor:
    """The activations as the kernel multiplies them, in float64."""
    q, unit = vnni_gemm.quantize(x)
    return (q.double().view(x.shape[0], -1, 32) * unit.double()[..., None]).view(x.shape)


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
@pytest.mark.parametrize(("out", "inp"), [(16, 256), (97, 512), (576, 1536)])
def test_the_product_is_the_float64_product_with_ggufs_dequantized_weight(qtype: QType, out: int, inp: int) -> None:
    blocks = _blocks(qtype, out, inp, seed=out + inp)
    layer = _layer(blocks)
    weight = _gguf_dequantized(blocks)
    # The kernel multiplies by exactly the weights gguf dequantizes to...
    assert torch.equal(layer.quant.dequantized(layer), weight)
    gen = torch.Generator().manual_seed(out)
    for m in (1, 2, 3, 4, 5, 7, 64, 131):
        x = torch.randn(m, inp, generator=gen)
        got = layer(x)
        want = (_as_multiplied(x) @ weight.double().t()).float()
        # ...with float32 scales and sums: only their order and rounding differ from float64's.
        torch.testing.assert_close(got, want, atol=2e-5 * want.abs().max().item(), rtol=1e-5)


# Packed bytes over the file's: the scales of a group of 16 rows are spread out for the kernel (Q6_K's
# nibbles and planes of high bits take exactly the file's bytes), IQ4_XS keeps its 4-bit indices (looked
# up in the loop) but spreads its scales out as bytes, and so does Q3_K (3 bits a weight in planes, its 6-bit
# scales as int8: 3.56 bits a weight against the file's 3.44). Q2_K's 4-bit scale and minimum per 16 weights
# share a byte as in the file (2 bits a weight in planes: 2.63 bits a weight, the file's).
PACKED_OVER_FILE = {  # Q4_K's and Q5_K's 6-bit scales and minimums packed as the file packs them (was 1.03)
    QType.Q4_K: 1.0,
    QType.Q5_K: 1.0,
    QType.Q6_K: 1.0,
    QType.Q3_K: 1.04,
    QType.IQ4_XS: 1.02,  # a scale a block of 32 (was 1.08: stored for each half)
    QType.Q2_K: 1.0,  # sc | m << 4 a byte, as the file (was 1.2: a byte each)
}


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
def test_a_packed_row_takes_about_the_files_bytes(qtype: QType) -> None:
    blocks = _blocks(qtype, 64, 1024, seed=1)
    layer = _layer(blocks)
    file_bytes = blocks.data.numel()
    assert file_bytes <= layer.quant.weight_bytes(layer) <= PACKED_OVER_FILE[qtype] * file_bytes


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
def test_a_rows_result_does_not_depend_on_the_other_rows_or_the_thread_count(qtype: QType) -> None:
    layer = _layer(_blocks(qtype, 200, 768, seed=5))
    x = torch.randn(300, 768, generator=torch.Generator().manual_seed(6))
    _rows_are_independent_of_the_batch_and_the_thread_count(layer, x)


@pytest.mark.parametrize("first", [32, 40], ids=["whole-groups", "a-split-group"])
def test_row_ranges_pack_as_their_concatenation(first: int) -> None:
    """A merged gate/up's two ranges are packed where they lie (whole groups of 16 rows) or joined first (a
    range that splits a group): either way the bytes of the concatenation."""
    whole = _blocks(QType.Q4_K, 72, 512, seed=9).data
    whole = whole.view(72, 2, -1)
    parts = [whole[:first].clone(), whole[first:].clone()]
    assert torch.equal(kquant_gemm.pack(parts, int(QType.Q4_K)), kquant_gemm.pack(whole, int(QType.Q4_K)))


def test_a_layer_whose_inputs_split_a_super_block_is_refused() -> None:
    with pytest.raises(ValueError, match="gguf-kquant needs input features divisible by 256; this layer has 288"):
        ReplicatedLinear(288, 16, False, quant_method_class("gguf-kquant")(torch.float32))


def test_the_kernel_refuses_a_format_it_has_no_code_for() -> None:
    with pytest.raises(ValueError, match="ggml type 2 is not a k-quant format the native kernel reads"):
        kquant_gemm.pack(torch.zeros(16, 1, 144, dtype=torch.uint8), int(QType.Q4_0))


@pytest.mark.parametrize(("qk", "vt"), [(QType.Q4_K, QType.Q6_K), (QType.Q3_K, QType.Q5_K)], ids=["Q4_K_M", "Q3_K_M"])
def test_a_packed_layer_stored_in_several_k_quants_is_one_product_of_its_segments(qk: QType, vt: QType) -> None:
    """Q4_K_M files keep some layers' v projection in Q6_K beside Q4_K q and k (Q3_K_M files: Q5_K beside
    Q3_K): the packed q/k/v layer holds its row ranges as segments, exactly as stored, and multiplies
    them in one call."""
    q, k, v = (
        _blocks(qk, 64, 512, seed=1),
        _blocks(qk, 32, 512, seed=2),
        _blocks(vt, 32, 512, 3),
    )
    layer = QKVParallelLinear(512, 16, 4, 2, False, quant_method_class("gguf-kquant")(torch.float32), TensorParallel())
    for shard, blocks in zip("vqk", (v, q, k)):  # pieces may arrive in any order
        layer.load_weight(blocks, shard)
    layer.finalize()
    assert layer.fmt == kquant_gemm.MIXED and layer.formats == f"{qk.name}/{vt.name}"
    weight = torch.cat([_gguf_dequantized(b) for b in (q, k, v)])
    assert torch.equal(layer.quant.dequantized(layer), weight)
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(4))
    want = (_as_multiplied(x) @ weight.double().t()).float()
    got = layer(x)
    torch.testing.assert_close(got, want, atol=2e-5 * want.abs().max().item(), rtol=1e-5)
    # Each segment's outputs are those of the same rows multiplied alone.
    alone = _layer(v)(x)
    assert torch.equal(got[:, 96:], alone)
    assert torch.equal(layer(x[4:5]), got[4:5])


def test_every_thread_count_takes_each_tile_of_a_packed_layers_segments_once() -> None:
    """The threads split a call's tiles (of one group for a few rows, two past them) across its segments in
    turn: with 9 groups of Q4_K and 3 of Q6_K (an odd tile at the end of each), every thread count gives the
    same bits, and each segment's outputs are its rows multiplied alone."""
    q, k, v = (
        _blocks(QType.Q4_K, 96, 512, seed=5),
        _blocks(QType.Q4_K, 48, 512, seed=6),
        _blocks(QType.Q6_K, 48, 512, 7),
    )
    layer = QKVParallelLinear(512, 16, 6, 3, False, quant_method_class("gguf-kquant")(torch.float32), TensorParallel())
    for shard, blocks in zip("qkv", (q, k, v)):
        layer.load_weight(blocks, shard)
    layer.finalize()
    assert layer.fmt == kquant_gemm.MIXED
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(8))
    threads = torch.get_num_threads()
    try:
        for rows in (x[:1], x[:3], x):
            torch.set_num_threads(1)
            want = layer(rows)
            assert torch.equal(want[:, 144:], _layer(v)(rows))
            for count in (2, 3, 5):
                torch.set_num_threads(count)
                assert torch.equal(layer(rows), want), (rows.shape[0], count)
    finally:
        torch.set_num_threads(threads)


def test_segments_that_split_a_group_of_16_rows_are_refused() -> None:
    with pytest.raises(ValueError, match="needs 16-row multiples before its last format; a range has 8 rows"):
        kquant_gemm.pack_segments(
            [(_blocks(QType.Q4_K, 8, 256, 1).data, 12), (_blocks(QType.Q6_K, 16, 256, 2).data, 14)]
        )


@pytest.mark.parametrize("qtype", [QType.Q4_K, QType.Q6_K, QType.Q4_0], ids=lambda t: t.name)
def test_a_row_of_tiny_or_huge_values_gets_the_same_bits_in_any_batch(qtype: QType) -> None:
    """A few rows are multiplied with 8-bit digit pairs (vpdpbusd), more as one int16 a value (vpdpwssd):
    the same integers, so the same bits, also for a block whose largest value is so small (below 127 *
    2^-126) that its unit is no normal float and a digit pair would overflow 16 bits, or whose values
    overflow float32."""
    k, n = 512, 48
    blocks = random_blocks(qtype, n, k, np.random.default_rng(3), scale=0.01)
    x = torch.randn(7, k, generator=torch.Generator().manual_seed(8))
    x[0, :32] *= 1e-38  # a unit far below float32's normal range
    x[1, 32:64] *= 3e-37
    x[2] = -1e-39 * x[2].abs()  # every block
    x[3, 96] = float("inf")
    x[4, :32] *= 1e36
    if qtype == QType.Q4_0:
        packed = vnni_gemm.pack(torch.from_numpy(blocks).view(n, k // 32, -1), int(qtype))
        full = vnni_gemm.vnni_gemm(x, packed, int(qtype), n)
        alone = vnni_gemm.vnni_gemm(x[:4], packed, int(qtype), n)
    else:
        packed = kquant_gemm.pack(torch.from_numpy(blocks).view(n, k // 256, -1), int(qtype))
        full = kquant_gemm.kquant_gemm(x, packed, int(qtype), n)
        alone = kquant_gemm.kquant_gemm(x[:4], packed, int(qtype), n)
    assert torch.equal(full[:4].view(torch.int32), alone.view(torch.int32))
    assert torch.isfinite(full[:3]).all() and torch.isfinite(full[4:]).all() and (full[2] != 0).any()
