"""DeepSeek-V3 on ``--backend triton`` (its interpreter on a CPU, float32): the latent attention and every
other op as triton kernels give transformers' logits (the kernel's own batch invariance is
tests/kernels/test_triton_latent_attention.py's)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.tiny_deepseek import deepseek_v3
from tests.triton_setup import DEVICE  # before anything imports triton: its interpreter without a GPU
from tokenmill_service.worker.engine.model_runner import forward_prompt
from tokenmill_service.worker.loader import load_model

transformers = pytest.importorskip("transformers")

PROMPT = torch.randint(0, 96, (16,), generator=torch.Generator().manual_seed(4)).tolist()


@pytest.fixture(scope="module")
def triton_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    """The q_lora model (YaRN, interleaved rope) on the triton backend, and transformers' model."""
    hf_model = deepseek_v3(q_lora=True)
    directory: Path = tmp_path_factory.mktemp("tiny-deepseek-triton")
    hf_model.save_pretrained(directory, safe_serialization=True)
    model = load_model(directory, dtype=torch.float32, quantization="none", backend="triton", device=DEVICE.type)
    return model, hf_model


@torch.inference_mode()
def test_the_triton_backend_gives_the_transformers_logits(triton_model: tuple[Any, Any]) -> None:
    model, hf_model = triton_model
    plan = model.plan.summary()
    assert model.plan.ops.value == "triton" and plan["kv_cache_layout"] == "latent blocks"
    actual = model.compute_logits(forward_prompt(model, PROMPT)).cpu()
    expected = hf_model(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=0)
