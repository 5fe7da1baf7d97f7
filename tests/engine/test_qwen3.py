"""Qwen3 (dense): tiny random transformers checkpoints, tied and untied, with head_dim 64 where
hidden / heads is 16, served as transformers computes them: logits and prompt logprobs within
1e-4 (float32, dense) on each ops backend (native CPU ops, the torch reference, triton), the same
greedy tokens, the same logits from a GGUF of the model and from two tensor-parallel ranks, a
prompt's logits bitwise the same alone and in a batch of others, and the native decoder stack (the
per-head q/k norms in its one call) with the bits of the model's own loop.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.engine.family_checks import (
    assert_greedy_matches,
    assert_prompt_matches,
    load,
    tensor_parallel_logits,
    whole_model_logits,
)
from tests.engine.invariance import assert_alone_equals_crowd
from tests.engine.test_gguf_loader import _randomize, convert_hf_to_gguf
from tests.kernels.test_decoder_stack import same_bits
from tokenmill_service.worker.loader import load_model
from tokenmill_service.worker.models.hf_loader import read_hf_config

transformers = pytest.importorskip("transformers")

TINY = dict(  # noqa: C408 - keyword names as in the transformers config
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,  # not hidden / heads (16); 64 is a head the native attention kernel takes
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)
PROMPT = torch.randint(0, TINY["vocab_size"], (40,), generator=torch.Generator().manual_seed(2)).tolist()
OPS = ["native", "torch", "triton"]


def qwen3(tied: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**TINY, tie_word_embeddings=tied))
    _randomize(model, seed=1)  # q_norm and k_norm too: every weight counts
    return model.eval()


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """A saved tiny Qwen3 and the transformers model it was saved from."""
    hf_model = qwen3(tied=request.param)
    directory = tmp_path_factory.mktemp("tiny-qwen3")
    hf_model.save_pretrained(directory, safe_serialization=True)
    return directory, hf_model


@pytest.mark.parametrize("ops", OPS)
@torch.inference_mode()
def test_logits_and_prompt_logprobs_are_the_transformers_ones(checkpoint: tuple[Path, Any], ops: str) -> None:
    directory, hf_model = checkpoint
    model = load(directory, ops)
    assert model.config.architecture == "qwen3" and model.config.head_dim == 64
    assert_prompt_matches(model, hf_model, PROMPT)


def test_the_config_and_the_weights_are_qwen3s(checkpoint: tuple[Path, Any]) -> None:
    directory, hf_model = checkpoint
    config = read_hf_config(directory)
    assert (config.architecture, config.head_dim, config.attention_bias) == ("qwen3", 64, False)
    assert config.tie_word_embeddings is hf_model.config.tie_word_embeddings
    model = load_model(directory)
    attn, hf_attn = model.model.layers[1].self_attn, hf_model.model.layers[1].self_attn
    assert torch.equal(attn.q_norm.weight, hf_attn.q_norm.weight)
    assert torch.equal(attn.k_norm.weight, hf_attn.k_norm.weight)
    if config.tie_word_embeddings:
        assert torch.equal(model.lm_head.quant.dequantized(model.lm_head), model.model.embed_tokens.weight)


@torch.inference_mode()
def test_the_native_stack_runs_the_per_head_norms_with_the_model_loops_bits(checkpoint: tuple[Path, Any]) -> None:
    """Served on the native ops, every layer runs in one native call: q and k normed head by head with
    the kernel and rows of the model's own loop (its ``before_rotary``), so its bits."""
    model = load(checkpoint[0], "native")
    assert model.plan.executor.value == "native-stack"
    same_bits(model)


def test_greedy_tokens_are_the_transformers_ones(checkpoint: tuple[Path, Any]) -> None:
    directory, hf_model = checkpoint
    assert_greedy_matches(load(directory, "native"), hf_model, PROMPT[:12], 10)


@pytest.mark.parametrize("ops", ["native", "torch"])
def test_a_prompt_is_bitwise_the_same_alone_and_in_a_batch(checkpoint: tuple[Path, Any], ops: str) -> None:
    """Prefill and the next decode step, alone and between two other sequences (block tables out of
    order), on the native ops as served and on the torch reference: the per-head norms, like every
    other op, compute each row on its own."""
    model = load(checkpoint[0], ops)
    assert_alone_equals_crowd(model, PROMPT)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_a_gguf_of_the_model_gives_the_same_logits(tmp_path: Path, tied: bool) -> None:
    hf_model = qwen3(tied)
    path = tmp_path / "tiny-qwen3.gguf"
    convert_hf_to_gguf(hf_model, "qwen3", path)  # llama.cpp's names: blk.N.attn_q_norm.weight, ...
    model = load_model(path)
    assert model.config.architecture == "qwen3" and model.config.head_dim == 64
    assert model.config.tie_word_embeddings is tied
    assert_prompt_matches(model, hf_model, PROMPT)


# -- tensor parallel (gloo on CPU, real processes; as tests/engine/test_tensor_parallel.py) -----------


def test_two_tensor_parallel_ranks_give_the_whole_models_logits(checkpoint: tuple[Path, Any], tmp_path: Path) -> None:
    directory, _ = checkpoint
    sharded = tensor_parallel_logits(directory, PROMPT, tmp_path)
    assert sharded["heads"] == 2 and sharded["q_norm"] == (64,)  # half the heads, the whole norm
    torch.testing.assert_close(sharded["logits"], whole_model_logits(directory, PROMPT), atol=1e-4, rtol=0)
