"""Mixture-of-experts families (Mixtral, Qwen3-MoE, OLMoE): tiny random transformers checkpoints (2 layers,
4 or 8 experts, top-2; Qwen3-MoE with a dense layer among its MoE ones) served as transformers computes them:
logits and prompt logprobs within 1e-4 at float32 with dense weights, the same greedy tokens, the same
logits from a GGUF of the model (llama.cpp's stacked expert tensors), a GGUF with Q8_0 experts in the
default configuration within its bounds of the float32 reference, a prompt's logits bitwise the same
alone and in a batch and prefilled or decoded, the native decoder stack (every layer in one native
call, the default) with the bits of the model's own loop, and the same logits from 2 and 4 ranks,
expert- or tensor-parallel."""

from __future__ import annotations

import socket
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType as QType

from tests.engine.invariance import assert_alone_equals_crowd, assert_prefill_equals_decode
from tests.engine.moe_ranks import rank_logits
from tests.engine.test_gguf_loader import _randomize, convert_hf_to_gguf
from tests.kernels.test_decoder_stack import same_bits
from tests.rank_processes import run_ranks
from tests.triton_setup import DEVICE  # before anything imports triton: its interpreter without a GPU
from tokenmill_service.contract.plan import LoadOptions, PlanRefused
from tokenmill_service.contract.plan.plan import Decision
from tokenmill_service.worker.device import probe_device
from tokenmill_service.worker.engine.model_runner import ModelRunner, StepPlan, forward_prompt
from tokenmill_service.worker.layers.fused_moe import FusedMoE
from tokenmill_service.worker.layers.linear import LinearBase
from tokenmill_service.worker.loader import load, load_model
from tokenmill_service.worker.models.checkpoint import open_checkpoint
from tokenmill_service.worker.plan.resolve import resolve_plan

transformers = pytest.importorskip("transformers")

COMMON = dict(  # noqa: C408 - keyword names as in the transformers configs
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,  # a head the native attention kernel takes
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    num_experts_per_tok=2,
)
PROMPT = torch.randint(0, COMMON["vocab_size"], (40,), generator=torch.Generator().manual_seed(2)).tolist()
FAMILIES = ["mixtral", "qwen3_moe", "olmoe"]
# llama.cpp writes Mixtral as a "llama" GGUF (q/k permuted) with expert counts.
GGUF_ARCH = {"mixtral": "llama", "qwen3_moe": "qwen3moe", "olmoe": "olmoe"}
EXPERTS = {"mixtral": 4, "qwen3_moe": 8, "olmoe": 4}


def hf_model(family: str, dense_layer: bool = True) -> Any:
    """``dense_layer``: Qwen3-MoE's second layer a dense MLP (``mlp_only_layers``); llama.cpp's
    qwen3moe GGUFs have experts in every layer."""
    torch.manual_seed(0)
    if family == "gpt_oss":
        from tests.engine.gpt_oss_checkpoint import hf_gpt_oss

        return hf_gpt_oss()
    if family == "mixtral":
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**COMMON, num_local_experts=4))
    elif family == "olmoe":  # its q/k norms are hidden wide: heads * head_dim must be the hidden size
        shape = {k: v for k, v in COMMON.items() if k != "head_dim"} | {"hidden_size": 256}
        model = transformers.OlmoeForCausalLM(transformers.OlmoeConfig(**shape, num_experts=4, norm_topk_prob=False))
    else:
        config = transformers.Qwen3MoeConfig(
            **COMMON,
            num_experts=8,
            moe_intermediate_size=64,
            norm_topk_prob=False,  # Mixtral renormalizes: this one shows the other way
            mlp_only_layers=[1] if dense_layer else [],
        )
        model = transformers.Qwen3MoeForCausalLM(config)
    _randomize(model, seed=1)
    return model.eval()


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, Any]:
    family = request.param
    model = hf_model(family)
    directory = tmp_path_factory.mktemp(f"tiny-{family}")
    model.save_pretrained(directory, safe_serialization=True)
    return family, directory, model


def hf_logits(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0]


@torch.inference_mode()
def test_logits_and_prompt_logprobs_are_the_transformers_ones(checkpoint: tuple[str, Path, Any]) -> None:
    family, directory, hf = checkpoint
    model = load_model(directory, dtype=torch.float32, quantization="none")
    assert model.config.architecture == family and model.plan.ops.value == "native"
    moe_layers = [isinstance(layer.mlp, FusedMoE) for layer in model.model.layers]
    assert moe_layers == ([True, False] if family == "qwen3_moe" else [True, True])
    assert model.config.extra["norm_topk_prob"] is (family == "mixtral")
    stored = sum(m.quant.weight_bytes(m) for m in model.modules() if isinstance(m, LinearBase))
    assert model.weight_bytes() < stored  # a token reads 2 of the experts' weights, not all of them
    actual = model.compute_logits(forward_prompt(model, PROMPT))
    expected = hf_logits(hf, PROMPT)
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(torch.log_softmax(actual, -1), torch.log_softmax(expected, -1), atol=1e-4, rtol=0)
    assert model.plan.executor.value == "native-stack"


@torch.inference_mode()
def test_the_triton_backend_gives_the_transformers_logits(tmp_path: Path) -> None:
    """The experts' SiLU-and-mul and every other op of the model as triton kernels (the interpreter on a CPU)."""
    hf = hf_model("qwen3_moe")
    hf.save_pretrained(tmp_path, safe_serialization=True)
    model = load_model(tmp_path, dtype=torch.float32, quantization="none", backend="triton", device=DEVICE.type)
    assert model.plan.ops.value == "triton"
    actual = model.compute_logits(forward_prompt(model, PROMPT[:16])).cpu()
    torch.testing.assert_close(actual, hf_logits(hf, PROMPT[:16]), atol=1e-4, rtol=0)


def greedy(model: Any, prompt: list[int], new_tokens: int) -> list[int]:
    runner = ModelRunner(model, block_size=16, num_blocks=8)
    ids, start, table = list(prompt), 0, list(range(8))
    for _ in range(new_tokens):
        new = ids[start:]
        logits, _ = runner.execute(StepPlan(new, [len(new)], [start], [table], [len(new) - 1], []))
        start = len(ids)
        ids.append(int(logits[0].argmax()))
    return ids[len(prompt) :]


def test_greedy_tokens_are_the_transformers_ones(checkpoint: tuple[str, Path, Any]) -> None:
    _, directory, hf = checkpoint
    ids = list(PROMPT[:12])
    for _ in range(8):
        ids.append(int(hf_logits(hf, ids)[-1].argmax()))
    assert greedy(load_model(directory), PROMPT[:12], 8) == ids[12:]


def test_a_prompt_is_bitwise_the_same_alone_and_in_a_batch_and_prefilled_or_decoded(
    checkpoint: tuple[str, Path, Any],
) -> None:
    model = load_model(checkpoint[1])
    assert model.plan.executor.value == "native-stack"
    assert_alone_equals_crowd(model, PROMPT)
    assert_prefill_equals_decode(model, PROMPT[:24], 16)


@torch.inference_mode()
def test_the_native_stack_gives_the_model_loops_bits(checkpoint: tuple[str, Path, Any]) -> None:
    """Every layer in one native call (OLMoE's whole-projection q/k norms, Qwen3-MoE's per-head ones and its
    dense layer, each MoE layer's router, top-k and experts) against the model's own loop under the native
    ops: prefills, decodes and mixed steps, the same bits."""
    same_bits(load_model(checkpoint[1]))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_gguf_of_the_model_gives_the_same_logits(tmp_path: Path, family: str) -> None:
    hf = hf_model(family, dense_layer=False)
    path = tmp_path / f"tiny-{family}.gguf"
    convert_hf_to_gguf(hf, GGUF_ARCH[family], path)
    checkpoint = open_checkpoint(path)
    assert checkpoint.tensor_types["model.layers.1.mlp.experts.3.down_proj.weight"] == QType.F32
    model = load_model(path)
    assert model.config.architecture == family
    with torch.inference_mode():
        actual = model.compute_logits(forward_prompt(model, PROMPT))
    torch.testing.assert_close(actual, hf_logits(hf, PROMPT), atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
@torch.inference_mode()
def test_a_sliding_window_on_every_layer_gives_the_transformers_logits(tmp_path: Path, family: str) -> None:
    """Mixtral's ``sliding_window`` and Qwen3-MoE's (with ``use_sliding_window``) window every layer, as
    transformers' mask does: 16 tokens under a prompt of 40, the model's whole context still served."""
    torch.manual_seed(0)
    if family == "mixtral":
        config = transformers.MixtralConfig(**COMMON, num_local_experts=4, sliding_window=16)
        hf = transformers.MixtralForCausalLM(config)
    else:
        config = transformers.Qwen3MoeConfig(
            **COMMON, num_experts=8, moe_intermediate_size=64, use_sliding_window=True, sliding_window=16
        )
        hf = transformers.Qwen3MoeForCausalLM(config)
    _randomize(hf, seed=1)
    hf.eval().save_pretrained(tmp_path, safe_serialization=True)
    model = load_model(tmp_path, dtype=torch.float32, quantization="none")
    assert [layer.self_attn.params.window for layer in model.model.layers] == [16, 16]
    assert model.config.max_position_embeddings == COMMON["max_position_embeddings"]
    actual = model.compute_logits(forward_prompt(model, PROMPT))
    torch.testing.assert_close(actual, hf_logits(hf, PROMPT), atol=1e-4, rtol=0)


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe"])
def q8_experts(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A GGUF whose stacked experts are Q8_0 (the rest float32)."""
    path = tmp_path_factory.mktemp("moe-q8") / f"{request.param}.gguf"
    hf = hf_model(request.param, dense_layer=False)
    convert_hf_to_gguf(hf, GGUF_ARCH[request.param], path, quantize=lambda n: QType.Q8_0 if "_exps" in n else QType.F32)
    return path


@torch.inference_mode()
def test_q8_0_experts_in_the_default_configuration_are_within_bounds_and_batch_invariant(q8_experts: Path) -> None:
    served = load(LoadOptions(model=str(q8_experts)))
    expert_methods = {c.method for p, c in served.plan.layers.items() if ".experts." in p}
    assert expert_methods <= {"gguf-vnni", "gguf"}, served.plan.layers  # the native kernels, as stored
    assert served.plan.layers["model.layers.0.mlp.gate"].method == "none"  # the F32 router
    reference = load(LoadOptions(model=str(q8_experts), quantization="none", dtype="float32"))
    got = torch.log_softmax(served.compute_logits(forward_prompt(served, PROMPT)), -1)
    want = torch.log_softmax(reference.compute_logits(forward_prompt(reference, PROMPT)), -1)
    targets = torch.tensor(PROMPT[1:])[:, None]
    error = (got[:-1].gather(1, targets) - want[:-1].gather(1, targets)).abs()
    assert error.mean() < 1e-3 and error.max() < 1e-2, (error.mean().item(), error.max().item())
    assert_alone_equals_crowd(served, PROMPT)
    same_bits(served)  # the default runs the native stack, with the model loop's bits
    # The default serves these experts in one native call a layer, as its plan says.
    assert served.plan.summary()["experts"].startswith("native ("), served.plan.summary()
    moes = [m for m in served.modules() if isinstance(m, FusedMoE)]
    assert moes and all(m.one_call and m.native() is not None for m in moes)


def test_expert_parallel_degrees_that_do_not_divide_the_experts_are_refused(checkpoint: tuple[str, Path, Any]) -> None:
    family, directory, _ = checkpoint
    experts = EXPERTS[family]
    options = LoadOptions(model=str(directory), tensor_parallel=3, expert_parallel=True)
    with pytest.raises(PlanRefused, match=f"{experts} experts \\(--expert-parallel gives each rank whole experts\\)"):
        resolve_plan(options, open_checkpoint(directory), probe_device("cpu"))


def test_expert_parallel_is_refused_for_a_model_without_experts(tmp_path: Path) -> None:
    torch.manual_seed(0)
    config = {k: v for k, v in COMMON.items() if k != "num_experts_per_tok"}
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).save_pretrained(tmp_path)
    options = LoadOptions(model=str(tmp_path), expert_parallel=True)
    with pytest.raises(PlanRefused, match="--expert-parallel needs a mixture-of-experts model; llama has no experts"):
        resolve_plan(options, open_checkpoint(tmp_path), probe_device("cpu"))


# -- several ranks (gloo on CPU, real processes; as tests/engine/test_tensor_parallel.py) ---------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize(
    ("ranks", "runs"),
    [
        (2, [("mixtral", True), ("qwen3_moe", True), ("qwen3_moe", False), ("gpt_oss", True)]),
        (4, [("qwen3_moe", True)]),
    ],
    ids=["2-ranks", "4-ranks"],
)
def test_several_ranks_give_the_whole_models_logits(tmp_path: Path, ranks: int, runs: list[tuple[str, bool]]) -> None:
    """Expert-parallel (whole experts, each rank its consecutive share) and tensor-parallel (every expert,
    a slice of each one's width): the logits of one rank within 1e-4 at float32 (gpt-oss: its experts'
    biases added once, its sinks cut by head)."""
    for family in {family for family, _ in runs}:
        hf_model(family).save_pretrained(tmp_path / family, safe_serialization=True)
    out = str(tmp_path / "logits")
    plan = [(str(tmp_path / family), expert_parallel) for family, expert_parallel in runs]
    run_ranks(rank_logits, (ranks, _free_port(), plan, PROMPT, out), ranks)
    for run, (family, expert_parallel) in enumerate(runs):
        results = [torch.load(f"{out}.{run}.{rank}") for rank in range(ranks)]
        experts, width = {"mixtral": (4, 128), "gpt_oss": (4, 64)}.get(family, (8, 64))
        if expert_parallel:
            share = experts // ranks
            for rank, result in enumerate(results):
                assert list(result["held"]) == [str(e) for e in range(rank * share, (rank + 1) * share)]
                assert set(result["held"].values()) == {(2 * width, 64)}
        else:
            for result in results:
                assert len(result["held"]) == experts and set(result["held"].values()) == {(2 * width // ranks, 64)}
        whole = load_model(tmp_path / family)
        with torch.inference_mode():
            expected = whole.compute_logits(forward_prompt(whole, PROMPT))
        for result in results:
            torch.testing.assert_close(result["logits"], expected, atol=1e-4, rtol=0)


def test_the_plan_runs_a_mixture_of_experts_in_the_native_stack_and_says_why_not_compiled(
    checkpoint: tuple[str, Path, Any],
) -> None:
    family, directory, _ = checkpoint
    options = LoadOptions(model=str(directory), dtype="float32", compile="auto")
    plan = resolve_plan(options, open_checkpoint(directory), probe_device("cpu"))
    assert plan.executor.value == "native-stack"
    assert "groups each step's tokens by expert" in plan.skipped["compile"]
    assert plan.experts is not None and plan.experts.value == "native", plan.experts
    torch_plan = resolve_plan(replace(options, backend="triton"), open_checkpoint(directory), probe_device("cpu"))
    assert torch_plan.experts == Decision("one-by-one", "the triton ops run them through the linear layers")
    assert torch_plan.executor.value == "eager"
    lora_plan = resolve_plan(replace(options, max_loras=2), open_checkpoint(directory), probe_device("cpu"))
    assert lora_plan.executor.value == "eager" and "LoRA adapters on experts" in lora_plan.executor.reason
    experts = [p for p in plan.layers if ".mlp.experts." in p]
    assert len(experts) == 2 * EXPERTS[family] * (1 if family == "qwen3_moe" else 2)  # gate/up and down each
