"""MXFP4 (gpt-oss's expert weights): dequantized bit for bit as transformers (its safetensors layout)
and gguf.quants (llama.cpp's block layout) define it, the one layout rewritten into the other without
changing a weight, and the blocks the native kernels multiply as stored (the VNNI kernel refusing a scale
float16 cannot hold)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from gguf.quants import dequantize as gguf_dequantize

from tokenmill_service.worker.kernels.cpu import block_gemm, vnni_gemm
from tokenmill_service.worker.layers.quant.mxfp4 import dequantize_openai, from_openai

transformers_mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")


def openai_tensor(scales_low: int, scales_high: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks [experts 2, rows 3, 4 blocks, 16 bytes] and scales [2, 3, 4] as transformers stores them."""
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (2, 3, 4, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(scales_low, scales_high, (2, 3, 4), generator=gen, dtype=torch.uint8)
    return blocks, scales


def test_the_safetensors_layout_dequantizes_as_transformers_does() -> None:
    blocks, scales = openai_tensor(0, 200)  # subnormal scales included (2^-127 ..)
    expected = transformers_mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
    assert torch.equal(dequantize_openai(blocks, scales).transpose(1, 2), expected)


def test_the_gguf_layout_dequantizes_as_gguf_does_and_holds_the_same_weights() -> None:
    blocks, scales = openai_tensor(0, 255, seed=1)
    gguf_blocks = from_openai(blocks, scales)
    assert gguf_blocks.qtype == QType.MXFP4 and gguf_blocks.shape == (6, 128)
    ours = gguf_blocks.dequantize()
    raw = gguf_blocks.data.numpy().reshape(6, 4 * 17)
    theirs = torch.from_numpy(np.asarray(gguf_dequantize(raw, QType.MXFP4))).reshape(6, 128)
    assert torch.equal(ours, theirs)
    assert torch.equal(ours, dequantize_openai(blocks, scales).reshape(6, 128))


@pytest.mark.skipif(vnni_gemm.unavailable_reason() is not None, reason="native kernels unavailable")
def test_the_native_kernels_read_the_blocks_as_stored_and_refuse_a_scale_float16_cannot_hold() -> None:
    blocks, scales = openai_tensor(104, 144, seed=2)  # every scale float16 holds (2^-24 .. 2^15 a unit)
    blocks[0, 0, 0] = 0  # a block of zeros, whatever its scale
    scales[0, 0, 0] = 3
    mxfp4 = from_openai(blocks, scales)
    rows, cols = mxfp4.shape
    fmt = int(QType.MXFP4)
    assert torch.equal(vnni_gemm.unpack(vnni_gemm.pack(mxfp4.data, fmt), fmt, rows, cols), mxfp4.dequantize())
    assert torch.equal(block_gemm.block_dequantize(mxfp4.data, fmt), mxfp4.dequantize())
    packed = vnni_gemm.pack(mxfp4.data, fmt)
    # A byte a block over the file's (d as float16, not E), in groups of 16 rows.
    assert packed.numel() == -(-rows // 16) * 16 * (mxfp4.data[0].numel() + 4)
    scales[1, 2, 3] = 144  # 2^17 an e2m1 unit: d = 2^16, beyond float16
    with pytest.raises(ValueError, match="MXFP4 block's scale is beyond.*--quantization none"):
        vnni_gemm.pack(from_openai(blocks, scales).data, fmt)
    # The float32 kernel reads any scale (subnormal ones included).
    blocks, scales = openai_tensor(0, 255, seed=3)
    wide = from_openai(blocks, scales)
    assert torch.equal(block_gemm.block_dequantize(wide.data, fmt), wide.dequantize())
    with pytest.raises(ValueError, match="do not pair up"):
        from_openai(blocks, scales[..., :3])
