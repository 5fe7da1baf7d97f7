"""Gemma 2: a tiny random transformers checkpoint (layer 0 with a sliding window of 8 tokens, layer 1
global, attention and final soft caps, query_pre_attn_scalar apart from head_dim) served as
transformers computes it over a prompt of five windows: logits and prompt logprobs within 1e-4
(float32, dense) on the native ops, the torch reference and triton (under its interpreter), the
same greedy tokens, the same logits from a GGUF of it and from two tensor-parallel ranks, and the
default configuration within the default's bounds.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.engine.family_checks import (
    assert_default_within_bounds,
    assert_greedy_matches,
    assert_prompt_matches,
    hf_logits,
    load,
    tensor_parallel_logits,
)
from tests.engine.gemma_checkpoints import PROMPT, WINDOW, convert_gemma_to_gguf, gemma2
from tokenmill_service.worker.engine.executor import make_executor
from tokenmill_service.worker.engine.model_runner import forward_prompt
from tokenmill_service.worker.loader import load_model

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """A saved tiny Gemma 2 and the transformers model it was saved from."""
    hf_model = gemma2()
    directory = tmp_path_factory.mktemp("tiny-gemma2")
    hf_model.save_pretrained(directory, safe_serialization=True)
    return directory, hf_model


@pytest.mark.parametrize("ops", ["native", "torch", "triton"])
@torch.inference_mode()
def test_logits_and_prompt_logprobs_are_the_transformers_ones(checkpoint: tuple[Path, Any], ops: str) -> None:
    directory, hf_model = checkpoint
    assert_prompt_matches(load(directory, ops), hf_model, PROMPT)


def test_the_config_and_the_weights_are_gemma2s(checkpoint: tuple[Path, Any]) -> None:
    directory, hf_model = checkpoint
    model = load(directory, "native")
    assert model.config.architecture == "gemma2" and model.config.tie_word_embeddings
    first, second = (layer.self_attn.params for layer in model.model.layers)
    assert (first.window, second.window) == (WINDOW, None)  # even layers local, as transformers' layer_types
    assert first.softcap == 10.0 and model.final_softcap == 5.0 and first.scale == 48**-0.5
    assert model.model.normalizer == 8.0  # sqrt(64)
    # Norms keep 1 + w, as transformers multiplies by it.
    hf_norm = hf_model.model.layers[1].post_feedforward_layernorm.weight
    assert torch.equal(model.model.layers[1].post_feedforward_layernorm.weight, 1.0 + hf_norm.float())


def test_the_window_and_the_soft_caps_each_count(checkpoint: tuple[Path, Any]) -> None:
    """Without its window, or either soft cap, the model is far from transformers' (so the match
    above is no accident of a window or a cap that never bites)."""
    directory, hf_model = checkpoint
    expected = hf_logits(hf_model, PROMPT)
    model = load(directory, "native")
    first, second = model.model.layers[0].self_attn, model.model.layers[1].self_attn
    for what, module, attribute, without in (
        ("window", first, "params", dataclasses.replace(first.params, window=None)),
        ("softcap", second, "params", dataclasses.replace(second.params, softcap=None)),
        ("final_softcap", model, "final_softcap", None),
    ):
        saved = getattr(module, attribute)
        setattr(module, attribute, without)
        with torch.inference_mode():
            actual = model.compute_logits(forward_prompt(model, PROMPT))
        setattr(module, attribute, saved)
        assert (actual - expected).abs().max() > 1e-2, what


def test_the_plan_runs_the_native_stack(checkpoint: tuple[Path, Any]) -> None:
    """GeGLU, the sandwich norms, the window and the soft cap in one native call a step (the transformers
    logits above are the stack's; tests/kernels/test_decoder_stack.py holds its bits to the eager loop's)."""
    model = load(checkpoint[0], "native")
    assert model.plan.executor.value == "native-stack", model.plan.executor
    assert make_executor(model).kind == "native-stack"


def test_greedy_tokens_are_the_transformers_ones(checkpoint: tuple[Path, Any]) -> None:
    directory, hf_model = checkpoint
    assert_greedy_matches(load(directory, "native"), hf_model, PROMPT[:12], 16)  # past three windows


def test_a_gguf_of_the_model_gives_the_same_logits(tmp_path: Path) -> None:
    """llama.cpp scales attention by head_dim ** -0.5 (it keeps no query_pre_attn_scalar), as Google's
    Gemma 2 configs but the 27B's do: the model converted is one whose scalar is its head_dim."""
    hf_model = gemma2(query_pre_attn_scalar=64)
    path = tmp_path / "tiny-gemma2.gguf"
    convert_gemma_to_gguf(hf_model, path)
    model = load_model(path, dtype=torch.float32, quantization="none")
    params = model.model.layers[0].self_attn.params
    assert model.config.architecture == "gemma2" and (params.window, params.softcap) == (WINDOW, 10.0)
    assert_prompt_matches(model, hf_model, PROMPT)


def test_the_default_configuration_is_within_the_defaults_bounds(checkpoint: tuple[Path, Any]) -> None:
    assert_default_within_bounds(*checkpoint, PROMPT)


def test_two_tensor_parallel_ranks_give_transformers_logits(checkpoint: tuple[Path, Any], tmp_path: Path) -> None:
    directory, hf_model = checkpoint
    sharded = tensor_parallel_logits(directory, PROMPT, tmp_path, float32=True)
    assert sharded["heads"] == 2  # half the heads each
    torch.testing.assert_close(sharded["logits"], hf_logits(hf_model, PROMPT), atol=1e-4, rtol=0)
