"""Gemma 3 (text): a tiny random transformers checkpoint of six layers (five local with a window of 8
tokens, one global; q/k norms; local rotary base 10^4, global 10^6 linearly scaled) served as
transformers computes it over a prompt of five windows: logits and prompt logprobs within 1e-4
(float32, dense) on the native ops and the torch reference, the same greedy tokens, the same
logits from a GGUF of it and from two tensor-parallel ranks, the default configuration within the
default's bounds, and a prompt's logits bitwise the same alone and in a crowd, prefilled or decoded.
"""

from __future__ import annotations

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
from tests.engine.gemma_checkpoints import PROMPT, WINDOW, convert_gemma_to_gguf, gemma3
from tests.engine.invariance import assert_alone_equals_crowd, assert_prefill_equals_decode
from tokenmill_service.worker.engine.executor import make_executor
from tokenmill_service.worker.loader import load_model
from tokenmill_service.worker.models.hf_loader import read_hf_config

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    hf_model = gemma3()
    directory = tmp_path_factory.mktemp("tiny-gemma3")
    hf_model.save_pretrained(directory, safe_serialization=True)
    return directory, hf_model


@pytest.mark.parametrize("ops", ["native", "torch"])
@torch.inference_mode()
def test_logits_and_prompt_logprobs_are_the_transformers_ones(checkpoint: tuple[Path, Any], ops: str) -> None:
    directory, hf_model = checkpoint
    assert_prompt_matches(load(directory, ops), hf_model, PROMPT)


def test_the_config_is_gemma3s(checkpoint: tuple[Path, Any]) -> None:
    directory, hf_model = checkpoint
    config = read_hf_config(directory)
    assert config.architecture == "gemma3" and config.extra["model_type"] == "gemma3_text"
    assert config.rope_theta == 1e6 and config.extra["rope_local_theta"] == 1e4
    assert config.extra["rope_linear_factor"] == 4.0
    model = load(directory, "native")
    attns = [layer.self_attn for layer in model.model.layers]
    assert [a.params.window for a in attns] == [WINDOW] * 5 + [None]
    assert {a.params.softcap for a in attns} == {None} and model.final_softcap is None
    local, global_ = attns[0].rotary, attns[5].rotary
    assert all(a.rotary is local for a in attns[:5]) and global_ is not local
    assert torch.equal(attns[2].q_norm.weight, 1.0 + hf_model.model.layers[2].self_attn.q_norm.weight.float())


def test_the_plan_runs_the_native_stack(checkpoint: tuple[Path, Any]) -> None:
    """Its windows, q/k norms and two rotary tables in one native call a step (the transformers logits above
    are the stack's; tests/kernels/test_decoder_stack.py holds its bits to the eager loop's)."""
    model = load(checkpoint[0], "native")
    assert model.plan.executor.value == "native-stack", model.plan.executor
    assert make_executor(model).kind == "native-stack"


def test_greedy_tokens_are_the_transformers_ones(checkpoint: tuple[Path, Any]) -> None:
    directory, hf_model = checkpoint
    assert_greedy_matches(load(directory, "native"), hf_model, PROMPT[:12], 12)  # to position 24, three windows


@pytest.mark.parametrize("ops", ["native", "torch"])
def test_a_prompt_is_bitwise_the_same_alone_in_a_crowd_and_prefilled_or_decoded(
    checkpoint: tuple[Path, Any], ops: str
) -> None:
    """Alone and between two other sequences; and a 26-token prompt (three windows and more) prefilled
    whole or its first 5 prefilled and the rest decoded, every position's logits the same bits."""
    model = load(checkpoint[0], ops)
    assert_alone_equals_crowd(model, PROMPT)
    assert_prefill_equals_decode(model, PROMPT[:26], prefilled=5)


def test_a_gguf_of_the_model_gives_the_same_logits(tmp_path: Path) -> None:
    hf_model = gemma3()
    path = tmp_path / "tiny-gemma3.gguf"
    convert_gemma_to_gguf(hf_model, path)  # no pattern key: llama.cpp's five local to one global
    model = load_model(path, dtype=torch.float32, quantization="none")
    assert model.config.architecture == "gemma3"
    assert [layer.self_attn.params.window for layer in model.model.layers] == [WINDOW] * 5 + [None]
    assert_prompt_matches(model, hf_model, PROMPT)


def test_the_default_configuration_is_within_the_defaults_bounds(checkpoint: tuple[Path, Any]) -> None:
    assert_default_within_bounds(*checkpoint, PROMPT)


def test_two_tensor_parallel_ranks_give_transformers_logits(checkpoint: tuple[Path, Any], tmp_path: Path) -> None:
    directory, hf_model = checkpoint
    sharded = tensor_parallel_logits(directory, PROMPT, tmp_path, float32=True)
    assert sharded["heads"] == 2
    torch.testing.assert_close(sharded["logits"], hf_logits(hf_model, PROMPT), atol=1e-4, rtol=0)
