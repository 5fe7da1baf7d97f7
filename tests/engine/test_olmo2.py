"""OLMo 2: tiny random transformers checkpoints, tied and untied, served as transformers computes them:
logits and prompt logprobs within 1e-4 (float32, dense) on each ops backend (native CPU ops, the torch
reference, triton), the same greedy tokens, the default configuration within its fidelity bounds, a prompt's
logits bitwise the same alone and in a batch of others. Its norms come after each sub-layer (none before),
which the native decoder stack does not run: the plan says so and runs the layers one by one. Its q/k norms
span every head, so tensor-parallel ranks are refused, naming why.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.engine.family_checks import assert_default_within_bounds, assert_greedy_matches, assert_prompt_matches, load
from tests.engine.invariance import assert_alone_equals_crowd
from tests.engine.test_gguf_loader import _randomize
from tokenmill_service.worker.distributed.parallel import TensorParallel
from tokenmill_service.worker.loader import load_model
from tokenmill_service.worker.models.hf_loader import read_hf_config

transformers = pytest.importorskip("transformers")

TINY = dict(  # noqa: C408 - keyword names as in the transformers config
    vocab_size=96,
    hidden_size=128,
    intermediate_size=192,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,  # head_dim 64: a head the native attention kernel takes; k_norm is 64 wide
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)
PROMPT = torch.randint(0, TINY["vocab_size"], (40,), generator=torch.Generator().manual_seed(3)).tolist()


def olmo2(tied: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    model = transformers.Olmo2ForCausalLM(transformers.Olmo2Config(**TINY, tie_word_embeddings=tied))
    _randomize(model, seed=1)  # the norms too: every weight counts
    return model.eval()


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """A saved tiny OLMo 2 and the transformers model it was saved from."""
    hf_model = olmo2(tied=request.param)
    directory = tmp_path_factory.mktemp("tiny-olmo2")
    hf_model.save_pretrained(directory, safe_serialization=True)
    return directory, hf_model


@pytest.mark.parametrize("ops", ["native", "torch", "triton"])
@torch.inference_mode()
def test_logits_and_prompt_logprobs_are_the_transformers_ones(checkpoint: tuple[Path, Any], ops: str) -> None:
    directory, hf_model = checkpoint
    model = load(directory, ops)
    assert model.config.architecture == "olmo2"
    assert_prompt_matches(model, hf_model, PROMPT)


def test_the_config_and_the_weights_are_olmo2s(checkpoint: tuple[Path, Any]) -> None:
    directory, hf_model = checkpoint
    config = read_hf_config(directory)
    assert (config.architecture, config.head_dim, config.attention_bias) == ("olmo2", 64, False)
    assert config.tie_word_embeddings is hf_model.config.tie_word_embeddings
    model = load_model(directory)
    layer, hf_layer = model.model.layers[1], hf_model.model.layers[1]
    assert not hasattr(layer, "input_layernorm")  # the sub-layers read the residual stream as it is
    assert layer.self_attn.q_norm.weight.shape == (128,) and layer.self_attn.k_norm.weight.shape == (64,)
    assert torch.equal(layer.self_attn.k_norm.weight, hf_layer.self_attn.k_norm.weight)
    assert torch.equal(layer.post_feedforward_layernorm.weight, hf_layer.post_feedforward_layernorm.weight)


def test_the_plan_runs_the_layers_one_by_one_and_says_why(checkpoint: tuple[Path, Any]) -> None:
    model = load(checkpoint[0], "native")
    assert model.plan.executor.value == "eager"
    assert "OLMo 2 norms only its sub-layers' outputs" in model.plan.executor.reason


def test_greedy_tokens_are_the_transformers_ones(checkpoint: tuple[Path, Any]) -> None:
    directory, hf_model = checkpoint
    assert_greedy_matches(load(directory, "native"), hf_model, PROMPT[:12], 10)


def test_the_default_configuration_is_within_its_bounds(checkpoint: tuple[Path, Any]) -> None:
    directory, hf_model = checkpoint
    assert_default_within_bounds(directory, hf_model, PROMPT)


@pytest.mark.parametrize("ops", ["native", "torch"])
def test_a_prompt_is_bitwise_the_same_alone_and_in_a_batch(checkpoint: tuple[Path, Any], ops: str) -> None:
    assert_alone_equals_crowd(load(checkpoint[0], ops), PROMPT)


def test_tensor_parallel_ranks_are_refused_naming_the_norms(checkpoint: tuple[Path, Any]) -> None:
    with pytest.raises(ValueError, match="olmo2's q/k norms span every attention head"):
        load_model(checkpoint[0], tp=TensorParallel(rank=0, size=2))
