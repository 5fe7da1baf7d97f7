"""Gemma 2: a tiny random transformers checkpoint (layer 0 with a sliding window of 8 tokens, layer 1
global, attention and final soft caps, query_pre_attn_scalar apart from head_dim) served as
transformers computes it over a prompt of five windows: logits and prompt logprobs within 1e-4
(float32, dense) on the native ops, the torch reference and triton (under its interpreter), the
same greedy tokens, the same logits from a GGUF of it and from two tensor-parallel ranks, and the
default configuration within the default's bounds.
"""

from __future__ import annotations

import dataclasses
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.engine.gemma_checkpoints import PROMPT, WINDOW, convert_gemma_to_gguf, gemma2
from tests.triton_setup import DEVICE  # before anything imports triton: its interpreter without a GPU
from tokenmill_service.distributed.parallel import TensorParallel
from tokenmill_service.engine.executor import make_executor
from tokenmill_service.engine.model_runner import forward_prompt
from tokenmill_service.models.builder import build_model
from tokenmill_service.models.checkpoint import open_checkpoint
from tokenmill_service.models.loader import load_model
from tokenmill_service.plan import LoadOptions
from tokenmill_service.plan.device import probe_device
from tokenmill_service.plan.resolve import resolve_plan

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """A saved tiny Gemma 2 and the transformers model it was saved from."""
    hf_model = gemma2()
    directory = tmp_path_factory.mktemp("tiny-gemma2")
    hf_model.save_pretrained(directory, safe_serialization=True)
    return directory, hf_model


def load(directory: Path, ops: str) -> Any:
    """The checkpoint at float32, dense, on the ``ops`` backend (``torch``: the reference ops, as a
    machine without tokenmill's native attention kernel gets them)."""
    if ops == "triton":
        return load_model(directory, dtype=torch.float32, quantization="none", backend="triton", device=DEVICE.type)
    facts = probe_device("cpu")
    if ops == "torch":
        facts = dataclasses.replace(facts, native_missing={**facts.native_missing, "paged_attention": "not asked"})
    checkpoint = open_checkpoint(directory)
    options = LoadOptions(model=str(directory), dtype="float32", quantization="none")
    model = build_model(resolve_plan(options, checkpoint, facts), checkpoint)
    assert model.plan.ops.value == ops
    return model


def hf_logits(hf_model: Any, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("ops", ["native", "torch", "triton"])
@torch.inference_mode()
def test_logits_and_prompt_logprobs_are_the_transformers_ones(checkpoint: tuple[Path, Any], ops: str) -> None:
    directory, hf_model = checkpoint
    model = load(directory, ops)
    actual = model.compute_logits(forward_prompt(model, PROMPT)).cpu()
    expected = hf_logits(hf_model, PROMPT)
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(torch.log_softmax(actual, -1), torch.log_softmax(expected, -1), atol=1e-4, rtol=0)


def test_the_config_and_the_weights_are_gemma2s(checkpoint: tuple[Path, Any]) -> None:
    directory, hf_model = checkpoint
    model = load(directory, "native")
    assert model.config.architecture == "gemma2" and model.config.tie_word_embeddings
    first, second = (layer.self_attn for layer in model.model.layers)
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
    for module, attribute in (
        (model.model.layers[0].self_attn, "window"),
        (model.model.layers[1].self_attn, "softcap"),
        (model, "final_softcap"),
    ):
        saved = getattr(module, attribute)
        setattr(module, attribute, None)
        with torch.inference_mode():
            actual = model.compute_logits(forward_prompt(model, PROMPT))
        setattr(module, attribute, saved)
        assert (actual - expected).abs().max() > 1e-2, attribute


def test_the_plan_says_the_native_stack_has_no_windows(checkpoint: tuple[Path, Any]) -> None:
    model = load(checkpoint[0], "native")
    assert model.plan.executor.value == "eager"
    assert "the gemma2 family has no native stack" in model.plan.executor.reason
    assert "sliding window" in model.plan.executor.reason
    with pytest.raises(ValueError, match="Gemma2ForCausalLM has no native stack"):
        make_executor(model, "native-stack")


def test_greedy_tokens_are_the_transformers_ones(checkpoint: tuple[Path, Any]) -> None:
    from tests.engine.test_qwen3 import greedy

    directory, hf_model = checkpoint
    ids = list(PROMPT[:12])
    for _ in range(16):  # past three windows: transformers' own greedy choice, one full forward per token
        ids.append(int(hf_logits(hf_model, ids)[-1].argmax()))
    assert greedy(load(directory, "native"), PROMPT[:12], 16) == ids[12:]


def test_a_gguf_of_the_model_gives_the_same_logits(tmp_path: Path) -> None:
    """llama.cpp scales attention by head_dim ** -0.5 (it keeps no query_pre_attn_scalar), as Google's
    Gemma 2 configs but the 27B's do: the model converted is one whose scalar is its head_dim."""
    hf_model = gemma2(query_pre_attn_scalar=64)
    path = tmp_path / "tiny-gemma2.gguf"
    convert_gemma_to_gguf(hf_model, path)
    model = load_model(path, dtype=torch.float32, quantization="none")
    attn = model.model.layers[0].self_attn
    assert model.config.architecture == "gemma2" and (attn.window, attn.softcap) == (WINDOW, 10.0)
    with torch.inference_mode():
        actual = model.compute_logits(forward_prompt(model, PROMPT))
    torch.testing.assert_close(actual, hf_logits(hf_model, PROMPT), atol=1e-4, rtol=0)


@torch.inference_mode()
def test_the_default_configuration_is_within_the_defaults_bounds(checkpoint: tuple[Path, Any]) -> None:
    directory, hf_model = checkpoint
    model = load_model(directory)  # the server's defaults: dtype, quantization, backend
    got = torch.log_softmax(make_executor(model).compute_logits(forward_prompt(model, PROMPT)).double(), -1)
    want = torch.log_softmax(hf_logits(hf_model, PROMPT).double(), -1)
    targets = torch.tensor(PROMPT[1:])[:, None]
    error = (got[:-1].gather(1, targets) - want[:-1].gather(1, targets)).abs()
    assert error.mean() < 1e-3 and error.max() < 1e-2, (error.mean().item(), error.max().item())


# -- tensor parallel (gloo on CPU, real processes; as tests/engine/test_tensor_parallel.py) -----------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_logits(rank: int, size: int, port: int, path: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    try:
        model = load_model(Path(path), dtype=torch.float32, quantization="none", tp=TensorParallel(rank, size))
        with torch.inference_mode():
            logits = model.compute_logits(forward_prompt(model, PROMPT))
        if rank == 0:
            torch.save({"logits": logits, "heads": model.model.layers[0].self_attn.num_heads}, out)
    finally:
        dist.destroy_process_group()


def test_two_tensor_parallel_ranks_give_transformers_logits(checkpoint: tuple[Path, Any], tmp_path: Path) -> None:
    directory, hf_model = checkpoint
    out = tmp_path / "logits.pt"
    mp.spawn(_rank_logits, args=(2, _free_port(), str(directory), str(out)), nprocs=2)
    sharded = torch.load(out)
    assert sharded["heads"] == 2  # half the heads each
    torch.testing.assert_close(sharded["logits"], hf_logits(hf_model, PROMPT), atol=1e-4, rtol=0)
