"""PEFT adapters of a Phi-3 target its fused projections (``qkv_proj``, ``gate_up_proj``: one A for the
parts, B's rows part after part); served on the packed layers, each part taking its slice of B, they give
transformers + PEFT's prompt logprobs within 1e-4 on a tiny random Phi-3 (float32, dense)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.engine.test_gguf_loader import _randomize
from tests.lora_adapters import make_adapter, peft_model
from tokenmill_service.worker.engine.model_runner import ModelRunner, StepPlan
from tokenmill_service.worker.layers.lora import read_adapter
from tokenmill_service.worker.loader import load_model

transformers = pytest.importorskip("transformers")

TINY_PHI3 = dict(  # noqa: C408 - keyword names as in the transformers config
    vocab_size=96, hidden_size=256, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
    pad_token_id=None, partial_rotary_factor=0.5,
)  # fmt: skip
PROMPT = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(4)).tolist()


@pytest.fixture(scope="module")
def phi3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    torch.manual_seed(0)
    model = transformers.Phi3ForCausalLM(transformers.Phi3Config(**TINY_PHI3))
    _randomize(model, seed=1)
    with torch.no_grad():  # halved, as tests/engine/test_phi3.py does: logits float32 keeps within 1e-4
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.mul_(0.5)
    directory = tmp_path_factory.mktemp("tiny-phi3")
    model.eval().save_pretrained(directory, safe_serialization=True)
    return directory, model


def test_a_phi3_adapter_of_the_fused_projections_gives_transformers_plus_peft(
    phi3: tuple[Path, Any], tmp_path: Path
) -> None:
    directory, hf = phi3
    targets = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    adapter = make_adapter(hf, tmp_path / "fused", 8, seed=5, targets=targets)
    model = load_model(directory, max_loras=2, max_lora_rank=8)
    read = read_adapter("fused", adapter, model.config, max_rank=8)
    assert read.targets == sorted(targets)  # the file holds the fused names: nothing was split before us
    model.lora.load(1, "fused", str(adapter))
    runner = ModelRunner(model, block_size=16, num_blocks=8)
    n = len(PROMPT)
    _, (logits,) = runner.execute(StepPlan(PROMPT, [n], [0], [[0, 1, 2]], [n - 1], [(0, n)], adapter_slots=[1]))
    with torch.inference_mode():
        theirs = torch.log_softmax(peft_model(hf, adapter)(torch.tensor([PROMPT])).logits[0], -1)
        plain = torch.log_softmax(hf(torch.tensor([PROMPT])).logits[0], -1)
    assert (theirs - plain).abs().max() > 0.05  # the adapter changes the model measurably
    torch.testing.assert_close(torch.log_softmax(logits, -1), theirs, atol=1e-4, rtol=0)
