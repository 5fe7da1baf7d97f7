"""Granite 3 (dense): tiny random transformers checkpoints, tied and untied, with Granite's four
multipliers away from 1 (and the attention scale away from 1/sqrt(head_dim)), served as transformers
computes them: logits and prompt logprobs within 1e-4 (float32, dense) on the native CPU ops and the
torch reference, the same greedy tokens, the same logits from a GGUF of the model (llama.cpp's
``granite.*`` keys) and from two tensor-parallel ranks, a prompt bitwise the same alone and in a
batch, and each multiplier shown to matter.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch

from tests.engine.family_checks import (
    assert_greedy_matches,
    assert_prompt_matches,
    hf_logits,
    load,
    tensor_parallel_logits,
    whole_model_logits,
)
from tests.engine.granite_phi3_checkpoints import GRANITE_TINY as TINY
from tests.engine.granite_phi3_checkpoints import MULTIPLIERS, granite
from tests.engine.invariance import assert_alone_equals_crowd
from tests.engine.test_gguf_loader import convert_hf_to_gguf
from tokenmill_service.worker.engine.executor import make_executor
from tokenmill_service.worker.engine.model_runner import forward_prompt
from tokenmill_service.worker.loader import load_model
from tokenmill_service.worker.models.hf_loader import read_hf_config

transformers = pytest.importorskip("transformers")

PROMPT = torch.randint(0, TINY["vocab_size"], (40,), generator=torch.Generator().manual_seed(2)).tolist()


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """A saved tiny Granite and the transformers model it was saved from."""
    hf_model = granite(tied=request.param)
    directory = tmp_path_factory.mktemp("tiny-granite")
    hf_model.save_pretrained(directory, safe_serialization=True)
    return directory, hf_model


@pytest.mark.parametrize("ops", ["native", "torch"])
@torch.inference_mode()
def test_logits_and_prompt_logprobs_are_the_transformers_ones(checkpoint: tuple[Path, Any], ops: str) -> None:
    directory, hf_model = checkpoint
    model = load(directory, ops)
    assert model.config.architecture == "granite"
    assert_prompt_matches(model, hf_model, PROMPT)


def test_the_config_carries_the_multipliers(checkpoint: tuple[Path, Any]) -> None:
    directory, hf_model = checkpoint
    config = read_hf_config(directory)
    assert config.architecture == "granite" and config.tie_word_embeddings is hf_model.config.tie_word_embeddings
    assert {key: config.extra[key] for key in MULTIPLIERS} == MULTIPLIERS


@pytest.mark.parametrize(
    ("multiplier", "where"),
    [
        ("embedding_multiplier", lambda m: [m.model]),
        ("attention_multiplier", lambda m: [ly.self_attn for ly in m.model.layers]),
        ("residual_multiplier", lambda m: list(m.model.layers)),
        ("logits_scaling", lambda m: [m]),
    ],
)
@torch.inference_mode()
def test_each_multiplier_counts(checkpoint: tuple[Path, Any], multiplier: str, where: Any) -> None:
    """Guards the comparison above: without any one of them (the native stack built after it is gone, as
    the plan runs the model) the logits are far from transformers'."""
    directory, hf_model = checkpoint
    model = load_model(directory)
    assert model.plan.executor.value == "native-stack"
    for module in where(model):
        if multiplier == "attention_multiplier":  # Llama's scale instead
            module.params = dataclasses.replace(module.params, scale=model.config.head_dim**-0.5)
        else:
            setattr(module, multiplier, 1.0)
    actual = model.compute_logits(forward_prompt(model, PROMPT))
    assert (actual - hf_logits(hf_model, PROMPT)).abs().max() > 1e-2


def test_the_plan_runs_the_native_stack_with_the_residual_multiplier(checkpoint: tuple[Path, Any]) -> None:
    """The logits test above runs it (the plan's executor); tests/kernels/test_decoder_stack.py holds its bits
    to the eager loop's."""
    model = load(checkpoint[0], "native")
    assert model.plan.executor.value == "native-stack", model.plan.executor
    stack = make_executor(model).stack.spec  # type: ignore[attr-defined]
    assert stack.residual_multiplier == MULTIPLIERS["residual_multiplier"]
    assert stack.scale == MULTIPLIERS["attention_multiplier"]


def test_greedy_tokens_are_the_transformers_ones(checkpoint: tuple[Path, Any]) -> None:
    directory, hf_model = checkpoint
    assert_greedy_matches(load(directory, "native"), hf_model, PROMPT[:12], 10)


@pytest.mark.parametrize("ops", ["native", "torch"])
def test_a_prompt_is_bitwise_the_same_alone_and_in_a_batch(checkpoint: tuple[Path, Any], ops: str) -> None:
    """Prefill and the next decode step, alone and between two other sequences (block tables out of order)."""
    model = load(checkpoint[0], ops)
    assert_alone_equals_crowd(model, PROMPT)


def _granite_keys(writer: gguf.GGUFWriter) -> None:
    """What llama.cpp's converter (GraniteModel) writes besides Llama's keys."""
    writer.add_embedding_scale(MULTIPLIERS["embedding_multiplier"])
    writer.add_attention_scale(MULTIPLIERS["attention_multiplier"])
    writer.add_residual_scale(MULTIPLIERS["residual_multiplier"])
    writer.add_logit_scale(MULTIPLIERS["logits_scaling"])


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_a_gguf_of_the_model_gives_the_same_logits(tmp_path: Path, tied: bool) -> None:
    hf_model = granite(tied)
    path = tmp_path / "tiny-granite.gguf"
    # llama.cpp's GraniteModel is its LlamaModel: q and k rows permuted for ggml's RoPE.
    convert_hf_to_gguf(hf_model, "granite", path, permute=True, metadata=_granite_keys)
    model = load_model(path)
    assert model.config.architecture == "granite" and model.config.tie_word_embeddings is tied
    assert_prompt_matches(model, hf_model, PROMPT)


# -- tensor parallel (gloo on CPU, real processes; as tests/engine/test_tensor_parallel.py) -----------


def test_two_tensor_parallel_ranks_give_the_whole_models_logits(checkpoint: tuple[Path, Any], tmp_path: Path) -> None:
    directory, _ = checkpoint
    sharded = tensor_parallel_logits(directory, PROMPT, tmp_path)
    assert sharded["heads"] == 2
    torch.testing.assert_close(sharded["logits"], whole_model_logits(directory, PROMPT), atol=1e-4, rtol=0)
