"""FP8 block-scaled weights (worker/layers/quant/fp8_tensor.py, fp8_block.py): slices keep their place in the
block grid, the layer holds exactly the reference's dequantized weight, and its product is close to the
dense one on both tile kernels, and each row's own (bitwise the same alone and among others) on the
native one."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as QType

from tests.tiny_deepseek import fp8_block_quantize, fp8_dequantize
from tokenmill_service.worker.distributed.parallel import TensorParallel
from tokenmill_service.worker.layers.linear import MergedColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from tokenmill_service.worker.layers.quant.fp8_block import NATIVE_TILES, SLICED_TILES, Fp8BlockMethod
from tokenmill_service.worker.layers.quant.fp8_tensor import Fp8Blocks
from tokenmill_service.worker.layers.quant.gguf_blocks import GGUFBlocks

BLOCK = 32


def _weight(rows: int, cols: int, seed: int = 0) -> tuple[Fp8Blocks, torch.Tensor]:
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    q, scale_inv = fp8_block_quantize(w, BLOCK)
    return Fp8Blocks(q, scale_inv, (BLOCK, BLOCK)), fp8_dequantize(q, scale_inv, BLOCK)


def test_a_slice_dequantizes_to_the_slice_of_the_reference() -> None:
    blocks, reference = _weight(100, 96)  # a partial last block of rows
    part = blocks.narrow(0, 37, 50).narrow(1, 32, 64)
    assert torch.equal(part.dequantize(), reference[37:87, 32:96])
    assert torch.equal(blocks.narrow(1, 5, 20).dequantize(), reference[:, 5:25])
    with pytest.raises(ValueError, match="splits its 32-column blocks"):
        blocks.narrow(1, 5, 20).column_block_scales()


@pytest.mark.parametrize("kernel", [NATIVE_TILES, SLICED_TILES])
@torch.inference_mode()
def test_a_layer_holds_the_reference_weight_and_multiplies_each_row_on_its_own(kernel: str) -> None:
    gate, gate_ref = _weight(48, 96, seed=1)  # packed at row 48: not a block boundary of the layer
    up, up_ref = _weight(48, 96, seed=2)
    layer = MergedColumnParallelLinear(96, [48, 48], False, Fp8BlockMethod(torch.float32, kernel), TensorParallel())
    layer.load_weight(gate, 0)
    layer.load_weight(up, 1)
    layer.finalize()
    reference = torch.cat((gate_ref, up_ref))
    assert layer.weight.dtype == torch.float8_e4m3fn
    assert torch.equal(layer.quant.dequantized(layer), reference)
    x = torch.randn(9, 96, generator=torch.Generator().manual_seed(3))
    crowd = layer(x)
    torch.testing.assert_close(crowd, x @ reference.T, atol=1e-4, rtol=1e-5)
    if kernel == NATIVE_TILES:  # by construction; the sliced fallback only as MKL does on Intel (README)
        for i in (0, 4, 8):
            assert torch.equal(layer(x[i : i + 1])[0], crowd[i])


def test_a_row_parallel_shard_must_hold_whole_column_blocks() -> None:
    blocks, _ = _weight(32, 96)
    layer = RowParallelLinear(96, 32, False, Fp8BlockMethod(torch.float32, SLICED_TILES), TensorParallel(1, 2))
    with pytest.raises(ValueError, match="splits its 32-column blocks"):
        layer.load_weight(blocks)  # rank 1's columns start at 48


def test_a_float_tensor_is_refused() -> None:
    layer = ReplicatedLinear(32, 32, False, Fp8BlockMethod(torch.float32, SLICED_TILES))
    with pytest.raises(ValueError, match="fp8-block serves FP8 block-scaled weights"):
        layer.load_weight(torch.zeros(32, 32))


def test_gguf_blocks_are_refused_clearly() -> None:
    # Once an AttributeError (the message read a dtype that GGUF blocks do not have).
    layer = ReplicatedLinear(32, 32, False, Fp8BlockMethod(torch.float32, SLICED_TILES))
    blocks = GGUFBlocks(QType.Q8_0, torch.zeros(32, 1, 34, dtype=torch.uint8))
    with pytest.raises(ValueError, match="fp8-block serves FP8 block-scaled weights, not a Q8_0 tensor"):
        layer.load_weight(blocks)
