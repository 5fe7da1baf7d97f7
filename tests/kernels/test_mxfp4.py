"""MXFP4 (gpt-oss's expert weights): dequantized bit for bit as transformers (its safetensors layout)
and gguf.quants (llama.cpp's block layout) define it, the one layout rewritten into the other without
changing a weight, and the exact Q8_0 form the native kernels multiply (refused where a scale has none)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from gguf.quants import dequantize as gguf_dequantize

from tokenmill_service.layers.quant.gguf_blocks import GGUFBlocks
from tokenmill_service.layers.quant.mxfp4 import as_q8_0, dequantize_openai, from_openai

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


def test_in_range_scales_rewrite_exactly_as_q8_0_and_others_are_refused() -> None:
    blocks, scales = openai_tensor(104, 144, seed=2)  # every scale float16 holds
    blocks[0, 0, 0] = 0  # a block of zeros, whatever its scale
    scales[0, 0, 0] = 3
    mxfp4 = from_openai(blocks, scales)
    q8 = as_q8_0(mxfp4)
    assert q8.qtype == QType.Q8_0 and q8.shape == mxfp4.shape
    assert torch.equal(q8.dequantize(), mxfp4.dequantize())
    scales[1, 2, 3] = 144  # 2^17 an e2m1 unit: d = 2^16, beyond float16
    with pytest.raises(ValueError, match="2\\^17 has no exact Q8_0 form.*--quantization none"):
        as_q8_0(from_openai(blocks, scales))
    with pytest.raises(ValueError, match="do not pair up"):
        from_openai(blocks, scales[..., :3])
    assert isinstance(mxfp4, GGUFBlocks)
