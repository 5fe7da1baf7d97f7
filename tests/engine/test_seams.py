"""The engine's seams: a quantization method or an ops implementation registered by name is picked up
without touching the model, and the runner and sampler make every tensor on the model's device."""

from __future__ import annotations

from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from tokenmill_service.contract.engine_config import EngineConfig
from tokenmill_service.contract.request import GenerationRequest, SamplingParams, StoppingParams
from tokenmill_service.worker.engine.llm_engine import LLMEngine
from tokenmill_service.worker.engine.model_runner import forward_prompt
from tokenmill_service.worker.kernels.interface import register_ops
from tokenmill_service.worker.kernels.torch_ops import TorchOps
from tokenmill_service.worker.layers.quant.base import register_quantization
from tokenmill_service.worker.layers.quant.dense import DenseMethod
from tokenmill_service.worker.loader import load_model

CALLS: dict[str, int] = {}


@register_quantization("toy-quant", help="dense weights, counting its products")
class ToyQuant(DenseMethod):
    """Dense weights, counting its products."""

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        CALLS["quant"] = CALLS.get("quant", 0) + 1
        return super().apply(layer, x)


@register_ops("toy-ops", help="the reference ops, counting attention calls")
class ToyOps(TorchOps):
    """The reference ops, counting attention calls."""

    def attention(self, *args: Any) -> torch.Tensor:
        CALLS["attention"] = CALLS.get("attention", 0) + 1
        return super().attention(*args)


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    path = tmp_path_factory.mktemp("tiny")
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    return path


def test_a_registered_quantization_method_is_picked_by_name(tiny_checkpoint: Path) -> None:
    CALLS.clear()
    toy = load_model(tiny_checkpoint, quantization="toy-quant")
    reference = load_model(tiny_checkpoint)
    assert toy.quantization == "toy-quant"
    ids = [1, 5, 9, 3]
    assert torch.equal(forward_prompt(toy, ids), forward_prompt(reference, ids))
    assert CALLS["quant"] == 2 * 4  # two layers of qkv, o, gate_up, down
    with pytest.raises(ValueError, match="unknown quantization 'nope'"):
        load_model(tiny_checkpoint, quantization="nope")


def test_a_registered_ops_implementation_is_picked_by_name(tiny_checkpoint: Path) -> None:
    CALLS.clear()
    toy = load_model(tiny_checkpoint, backend="toy-ops")
    ids = [1, 5, 9, 3]
    assert torch.equal(forward_prompt(toy, ids), forward_prompt(load_model(tiny_checkpoint), ids))
    assert CALLS["attention"] == 2
    with pytest.raises(ValueError, match="unknown backend 'nope'"):
        load_model(tiny_checkpoint, backend="nope")


FACTORIES = {
    torch.tensor,
    torch.zeros,
    torch.ones,
    torch.empty,
    torch.full,
    torch.arange,
    torch.rand,
    torch.randn,
    torch.randint,
    torch.linspace,
    torch.eye,
    torch.as_tensor,
}


class DeviceDiscipline(TorchFunctionMode):
    """Fails on a tensor made without naming its device, or on an operation that mixes devices.

    On the CPU this is what proves a GPU path: a factory that relies on the default device would
    put its tensor on the CPU beside a model on the GPU."""

    def __init__(self) -> None:
        super().__init__()
        self.violations: list[str] = []

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Collection[type],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func in FACTORIES and kwargs.get("device") is None:
            self.violations.append(f"{func.__name__} without device=")
        devices = {a.device for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)}
        if len(devices) > 1:
            self.violations.append(f"{getattr(func, '__name__', func)} mixes {devices}")
        return func(*args, **kwargs)


def test_the_runner_and_sampler_name_the_device_of_every_tensor(default_model: Any, default_tokenizer: Any) -> None:
    engine = LLMEngine(default_model, default_tokenizer, EngineConfig(max_batch_size=4, num_kv_blocks=64))
    prompt = default_tokenizer.encode("The quick brown fox jumps")
    sampled = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, repetition_penalty=1.3, seed=1)
    engine.add_request(
        GenerationRequest(
            "s",
            prompt,
            sampled,
            StoppingParams(max_new_tokens=3, ignore_eos=True),
            logprobs=True,
            top_logprobs=3,
            prompt_logprobs=True,
        )
    )
    engine.add_request(GenerationRequest("g", prompt[:3], stopping=StoppingParams(max_new_tokens=3, ignore_eos=True)))
    mode = DeviceDiscipline()
    with mode:
        while engine.has_unfinished():  # prefill, then decodes, with sampling and prompt logprobs
            engine.step()
    assert mode.violations == []


def test_the_device_check_catches_a_tensor_made_without_its_device() -> None:
    mode = DeviceDiscipline()
    with mode:
        torch.tensor([1, 2])
        torch.arange(3, device="cpu")
    assert mode.violations == ["tensor without device="]


def test_every_declared_backend_and_quantization_has_its_implementation_and_only_those() -> None:
    """--backend and --quantization take their values from contract/plan/choices.py; each names a registered
    implementation (auto aside), and an implementation registers under a declared value only."""
    from tokenmill_service.contract.plan import choices
    from tokenmill_service.worker.kernels.interface import ops_class
    from tokenmill_service.worker.layers.quant import quant_method_class

    for value in choices.BACKEND.values(selectable_only=False):
        assert ops_class(value).name == value
    for value in choices.QUANTIZATION.values(selectable_only=False):
        if value != "auto":
            assert quant_method_class(value).name == value
    with pytest.raises(ValueError, match="'made-up' is not a value of --quantization"):
        register_quantization("made-up")(DenseMethod)
