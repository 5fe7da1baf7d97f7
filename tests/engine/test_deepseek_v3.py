"""DeepSeek-V3: tiny random transformers checkpoints, with and without the low-rank query path, served
through multi-head latent attention over a latent cache: logits and prompt logprobs within 1e-4 of
transformers (float32, dense), the same greedy tokens, a prompt's logits bitwise the same alone and in
a batch and whether its positions were prefilled or decoded, FP8 block-scaled weights multiplied as
stored (exactly the reference's dequantized weights), two tensor-parallel ranks equal to one, the
cache's bytes per token (DeepSeek-V3's real figure). With expert layers (a dense first layer, 8 routed
experts in 2 groups, grouped sigmoid routing, a shared expert): transformers' logits, greedy tokens,
batch invariance, the GGUF as llama.cpp writes it, two expert- or tensor-parallel ranks equal to one;
softmax routing refused."""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.engine.invariance import assert_alone_equals_crowd
from tests.rank_processes import run_ranks
from tests.tiny_deepseek import YARN, deepseek_v3, save_fp8, write_deepseek2_gguf
from tokenmill_service.contract.model_dims import read_dims
from tokenmill_service.contract.plan.plan import PlanRefused
from tokenmill_service.worker.distributed.parallel import TensorParallel
from tokenmill_service.worker.engine.model_runner import ModelRunner, StepPlan, forward_prompt, kv_bytes_per_block
from tokenmill_service.worker.kernels.cpu import latent_attention
from tokenmill_service.worker.layers.fused_moe import FusedMoE, GroupedTopK
from tokenmill_service.worker.loader import load_model
from tokenmill_service.worker.models.decoder import GatedMLP
from tokenmill_service.worker.models.deepseek_v3 import DeepseekV3MoE
from tokenmill_service.worker.models.hf_loader import read_hf_config
from tokenmill_service.worker.models.registry import family as family_spec
from tokenmill_service.worker.plan.resolve import kv_cache_bytes_per_token

transformers = pytest.importorskip("transformers")

PROMPT = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(2)).tolist()
FP8_BLOCK = 32  # DeepSeek-V3's files use 128; 32 gives the tiny layers several blocks each way


@pytest.fixture(scope="module", params=[True, False], ids=["q_lora", "no_q_lora"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    hf_model = deepseek_v3(q_lora=request.param)
    directory = tmp_path_factory.mktemp("tiny-deepseek")
    hf_model.save_pretrained(directory, safe_serialization=True)
    return directory, hf_model


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """3 layers, the first dense; q_lora on."""
    hf_model = deepseek_v3(q_lora=True, moe=True)
    directory = tmp_path_factory.mktemp("tiny-deepseek-moe")
    hf_model.save_pretrained(directory, safe_serialization=True)
    return directory, hf_model


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, dict[str, torch.Tensor]]:
    """The q_lora model FP8 block-quantized, and transformers' model on the weights the file stands for."""
    hf_model = deepseek_v3(q_lora=True)
    directory = tmp_path_factory.mktemp("tiny-deepseek-fp8")
    dequantized = save_fp8(hf_model, directory, FP8_BLOCK)
    hf_model.load_state_dict(dequantized)
    return directory, hf_model, dequantized


def hf_logits(hf_model: Any, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(torch.tensor([ids])).logits[0]


def logits(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model.compute_logits(forward_prompt(model, ids))


@torch.inference_mode()
def test_logits_and_prompt_logprobs_are_the_transformers_ones(checkpoint: tuple[Path, Any]) -> None:
    directory, hf_model = checkpoint
    model = load_model(directory, dtype=torch.float32, quantization="none")
    plan = model.plan.summary()
    assert plan["architecture"] == "deepseek_v3" and plan["kv_cache_layout"] == "latent blocks"
    if latent_attention.unavailable_reason() is None:  # the default on a CPU: the native latent attention
        assert plan["ops"].startswith("native")
    actual, expected = logits(model, PROMPT), hf_logits(hf_model, PROMPT)
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(torch.log_softmax(actual, -1), torch.log_softmax(expected, -1), atol=1e-4, rtol=0)


def greedy(model: Any, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy tokens through the runner's paged latent cache: a prefill, then one decode step per token."""
    runner = ModelRunner(model, block_size=16, num_blocks=8)
    ids, start, table = list(prompt), 0, list(range(8))
    for _ in range(new_tokens):
        new = ids[start:]
        out, _ = runner.execute(StepPlan(new, [len(new)], [start], [table], [len(new) - 1], []))
        start = len(ids)
        ids.append(int(out[0].argmax()))
    return ids[len(prompt) :]


def test_greedy_tokens_are_the_transformers_ones(checkpoint: tuple[Path, Any]) -> None:
    directory, hf_model = checkpoint
    ids = list(PROMPT[:12])
    for _ in range(10):
        ids.append(int(hf_logits(hf_model, ids)[-1].argmax()))
    assert greedy(load_model(directory), PROMPT[:12], 10) == ids[12:]


def test_a_prompt_is_bitwise_the_same_alone_and_in_a_batch(checkpoint: tuple[Path, Any]) -> None:
    assert_alone_equals_crowd(load_model(checkpoint[0]), PROMPT)


@torch.inference_mode()
def test_positions_decoded_one_by_one_give_the_prefills_logits_bitwise(checkpoint: tuple[Path, Any]) -> None:
    """The absorbed attention serves prefill chunks and decode tokens alike: a prompt prefilled whole,
    in two chunks, or token by token gives each position bitwise the same logits."""
    model = load_model(checkpoint[0])
    ids, table = PROMPT[:14], [5, 2, 7, 0]

    def run(chunks: list[int]) -> torch.Tensor:
        runner = ModelRunner(model, block_size=4, num_blocks=8)
        rows, start = [], 0
        for n in chunks:
            _, (out,) = runner.execute(StepPlan(ids[start : start + n], [n], [start], [table], [n - 1], [(0, n)]))
            rows.append(out)
            start += n
        return torch.cat(rows)

    whole = run([14])
    assert torch.equal(run([9, 5]), whole)
    assert torch.equal(run([1] * 14), whole)


def test_kv_b_proj_is_kept_once_its_halves_views_of_it(checkpoint: tuple[Path, Any]) -> None:
    """The absorbed form's w_uk and w_uv are views of the one float32 copy of kv_b_proj's weight (a
    float32 checkpoint's own tensor); the layer itself is dropped, never applied."""
    directory, hf_model = checkpoint
    attn = load_model(directory, dtype=torch.float32, quantization="none").model.layers[0].self_attn
    assert not hasattr(attn, "kv_b_proj")
    expected = hf_model.model.layers[0].self_attn.kv_b_proj.weight
    assert torch.equal(attn.w_kv_b.flatten(0, 1), expected)
    storage = attn.w_kv_b.untyped_storage().data_ptr()
    w_uk, w_uv = attn.params.w_uk, attn.params.w_uv
    assert w_uk.untyped_storage().data_ptr() == storage == w_uv.untyped_storage().data_ptr()
    assert attn.w_kv_b.untyped_storage().nbytes() == expected.numel() * 4


@torch.inference_mode()
def test_a_gguf_as_llama_cpp_converts_it_gives_the_same_logits(tmp_path: Path) -> None:
    """llama.cpp's deepseek2: k_b / v_b joined back into kv_b_proj, YaRN from its keys (DeepSeek's
    configs have mscale equal to mscale_all_dim, which is all the file keeps)."""
    hf_model = deepseek_v3(q_lora=True, yarn={**YARN, "mscale": 0.8, "mscale_all_dim": 0.8})
    path = tmp_path / "tiny-deepseek.gguf"
    write_deepseek2_gguf(hf_model, path)
    model = load_model(path)
    assert model.config.architecture == "deepseek_v3" and model.config.extra["gguf_architecture"] == "deepseek2"
    torch.testing.assert_close(logits(model, PROMPT), hf_logits(hf_model, PROMPT), atol=1e-4, rtol=0)


def test_fp8_block_weights_are_served_as_stored_and_exactly_dequantized(
    fp8_checkpoint: tuple[Path, Any, dict[str, torch.Tensor]],
) -> None:
    directory, hf_model, dequantized = fp8_checkpoint
    model = load_model(directory, quantization="auto")
    assert model.plan.method_counts == {"fp8-block": 14, "none": 1}  # every projection; the head is float
    assert "FP8 blocks (e4m3, a float32 scale per 32x32)" in model.plan.quant_reasons["fp8-block"]
    attn = model.model.layers[1].self_attn
    assert attn.q_b_proj.weight.dtype == torch.float8_e4m3fn  # one byte a weight, as the file stores it
    for name in ("q_b_proj", "kv_a_proj_with_mqa", "o_proj"):
        layer = getattr(attn, name)
        assert torch.equal(layer.quant.dequantized(layer), dequantized[f"model.layers.1.self_attn.{name}.weight"])
    # kv_b_proj is kept as the absorbed attention multiplies it: dequantized, float32.
    assert torch.equal(attn.w_kv_b.flatten(0, 1), dequantized["model.layers.1.self_attn.kv_b_proj.weight"])
    gate_up = model.model.layers[0].mlp.gate_up_proj
    reference = torch.cat([dequantized[f"model.layers.0.mlp.{p}_proj.weight"] for p in ("gate", "up")])
    assert torch.equal(gate_up.quant.dequantized(gate_up), reference)
    torch.testing.assert_close(logits(model, PROMPT), hf_logits(hf_model, PROMPT), atol=1e-4, rtol=0)
    assert_alone_equals_crowd(model, PROMPT)


def test_the_cache_holds_a_latent_and_a_rotary_key_per_token_and_layer(checkpoint: tuple[Path, Any]) -> None:
    model = load_model(checkpoint[0])
    latent, rope = model.kv_cache_shapes(num_blocks=3, block_size=16)
    assert latent == (2, 3, 16, 1, 64) and rope == (2, 3, 16, 1, 64)  # kv_lora_rank, qk_rope_head_dim
    per_token = kv_bytes_per_block(model, 16, torch.float32) // 16
    assert per_token == 2 * (64 + 64) * 4 == int(model.plan.kv_cache_bytes_per_token.value)
    # Against 4 heads x (a 96-dim key + a 32-dim value) per layer.
    assert "a per-head cache would take 4096 bytes (4.0x)" in model.plan.kv_cache_bytes_per_token.reason


def test_deepseek_v3s_real_config_caches_70272_bytes_a_token_against_4997120(tmp_path: Path) -> None:
    """DeepSeek-V3 (transformers' DeepseekV3Config defaults are its published config): 61 layers of a
    512-value latent and a 64-value rotary key, bfloat16, against 128 heads x (192 + 128) per layer."""
    real = transformers.DeepseekV3Config()
    (tmp_path / "config.json").write_text(json.dumps({**real.to_dict(), "architectures": ["DeepseekV3ForCausalLM"]}))
    config = read_hf_config(tmp_path)
    family = family_spec(config.architecture)
    latent, per_head = family.kv_cache_values_per_token(config)
    assert latent == 61 * (512 + 64) == 35136
    assert per_head == 61 * 128 * ((128 + 64) + 128) == 2498560
    figure = kv_cache_bytes_per_token(family, config, "bfloat16", tensor_parallel=1)
    assert figure.value == str(35136 * 2) == "70272"
    assert "a per-head cache would take 4997120 bytes (71.1x)" in figure.reason
    # Its layers after the first three are mixture-of-experts layers, served with its routing.
    assert family.unserved_reason(config) is None
    extra = config.extra
    assert (extra["num_experts"], extra["experts_per_token"], extra["expert_width"]) == (256, 8, 2048)
    assert extra["moe_layers"] == list(range(3, 61)) and extra["shared_expert_width"] == 2048
    assert extra["moe_routing"] == GroupedTopK(n_group=8, topk_group=4, scaling=2.5)


def test_the_multi_token_prediction_layer_after_the_decoders_is_left_aside(
    checkpoint: tuple[Path, Any], tmp_path: Path
) -> None:
    """DeepSeek-V3's files keep their MTP layer as model.layers.<num_hidden_layers>: not a decoder layer."""
    from safetensors.torch import load_file, save_file

    directory = tmp_path / "with-mtp"
    shutil.copytree(checkpoint[0], directory)
    tensors = load_file(directory / "model.safetensors")
    tensors["model.layers.2.self_attn.kv_a_layernorm.weight"] = torch.ones(64)
    tensors["model.layers.2.eh_proj.weight"] = torch.ones(64, 128)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    model = load_model(directory)
    assert len(model.model.layers) == 2
    torch.testing.assert_close(logits(model, PROMPT[:8]), hf_logits(checkpoint[1], PROMPT[:8]), atol=1e-4, rtol=0)


# -- mixture-of-experts layers -------------------------------------------------------------------------


@torch.inference_mode()
def test_expert_layers_give_the_transformers_logits_and_prompt_logprobs(moe_checkpoint: tuple[Path, Any]) -> None:
    directory, hf_model = moe_checkpoint
    model = load_model(directory, dtype=torch.float32, quantization="none")
    kinds = [type(layer.mlp) for layer in model.model.layers]
    assert kinds == [GatedMLP, DeepseekV3MoE, DeepseekV3MoE]
    moe = model.model.layers[1].mlp
    assert moe.grouped == GroupedTopK(n_group=2, topk_group=1, scaling=2.5) and moe.top_k == 2 and moe.renormalize
    assert moe.shared_experts is not None  # moe_intermediate_size x 1 shared expert wide
    down = moe.shared_experts.down_proj
    assert down.quant.dequantized(down).shape == (64, 32)
    hf_bias = hf_model.model.layers[1].mlp.gate.e_score_correction_bias
    assert torch.equal(moe.score_bias, hf_bias)
    actual, expected = logits(model, PROMPT), hf_logits(hf_model, PROMPT)
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(torch.log_softmax(actual, -1), torch.log_softmax(expected, -1), atol=1e-4, rtol=0)


def test_expert_layers_give_the_transformers_greedy_tokens(moe_checkpoint: tuple[Path, Any]) -> None:
    directory, hf_model = moe_checkpoint
    ids = list(PROMPT[:12])
    for _ in range(10):
        ids.append(int(hf_logits(hf_model, ids)[-1].argmax()))
    assert greedy(load_model(directory), PROMPT[:12], 10) == ids[12:]


def test_with_expert_layers_a_prompt_is_bitwise_the_same_alone_and_in_a_batch(
    moe_checkpoint: tuple[Path, Any],
) -> None:
    assert_alone_equals_crowd(load_model(moe_checkpoint[0]), PROMPT)


@torch.inference_mode()
def test_a_gguf_with_expert_layers_gives_the_same_logits(tmp_path: Path) -> None:
    """llama.cpp's deepseek2 with experts: stacked ffn_*_exps, ffn_*_shexp, exp_probs_b, the expert_* keys
    (YaRN's mscale equal to mscale_all_dim, as the file keeps only one)."""
    hf_model = deepseek_v3(q_lora=True, yarn={**YARN, "mscale": 0.8, "mscale_all_dim": 0.8}, moe=True)
    path = tmp_path / "tiny-deepseek-moe.gguf"
    write_deepseek2_gguf(hf_model, path)
    model = load_model(path)
    moe = model.model.layers[2].mlp
    assert isinstance(moe, DeepseekV3MoE) and moe.grouped == GroupedTopK(2, 1, 2.5) and moe.renormalize
    torch.testing.assert_close(logits(model, PROMPT), hf_logits(hf_model, PROMPT), atol=1e-4, rtol=0)


@torch.inference_mode()
def test_fp8_expert_layers_are_multiplied_as_stored(tmp_path: Path) -> None:
    """Every routed and shared expert FP8 block-scaled (the routers float, as DeepSeek stores them): the
    logits of the float32 checkpoint of the weights the file stands for, and batch invariance."""
    from safetensors.torch import save_file

    hf_model = deepseek_v3(q_lora=True, moe=True)
    dequantized = save_fp8(hf_model, tmp_path / "fp8", FP8_BLOCK)
    hf_model.save_pretrained(tmp_path / "float", safe_serialization=True)
    save_file(dequantized, tmp_path / "float" / "model.safetensors", metadata={"format": "pt"})
    model = load_model(tmp_path / "fp8", quantization="auto")
    # 3 layers' attention (5 each), the dense MLP (2), 2 layers' experts (8 x 2 + shared 2); the head and routers float.
    assert model.plan.method_counts == {"fp8-block": 53, "none": 3}
    expert = model.model.layers[2].mlp.experts["5"].down_proj
    assert expert.weight.dtype == torch.float8_e4m3fn
    assert torch.equal(expert.quant.dequantized(expert), dequantized["model.layers.2.mlp.experts.5.down_proj.weight"])
    reference = load_model(tmp_path / "float")
    torch.testing.assert_close(logits(model, PROMPT), logits(reference, PROMPT), atol=1e-4, rtol=0)
    assert_alone_equals_crowd(model, PROMPT)


def test_the_sizes_read_before_loading_count_the_routed_experts_where_layers_have_them(
    checkpoint: tuple[Path, Any], moe_checkpoint: tuple[Path, Any]
) -> None:
    """What the server checks --tensor-parallel / --expert-parallel degrees against (contract/model_dims.py)."""
    dims = read_dims(moe_checkpoint[0])
    assert (dims.num_experts, dims.expert_width) == (8, 32)
    assert read_dims(checkpoint[0]).num_experts == 0  # n_routed_experts 8, but every layer dense


def test_softmax_routing_and_groups_that_cannot_hold_the_experts_are_refused(
    moe_checkpoint: tuple[Path, Any], tmp_path: Path
) -> None:
    config = json.loads((moe_checkpoint[0] / "config.json").read_text())
    for name, change, refusal in [
        ("softmax", {"scoring_func": "softmax"}, "routes its experts by softmax scores; only DeepSeek-V3's sigmoid"),
        ("groups", {"n_group": 3}, "8 routed experts do not split into 3 equal groups"),
    ]:
        shutil.copytree(moe_checkpoint[0], tmp_path / name)
        (tmp_path / name / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(PlanRefused, match=refusal):
            load_model(tmp_path / name)


# -- tensor parallel (gloo on CPU, real processes; as tests/engine/test_tensor_parallel.py) -----------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_logits(rank: int, size: int, port: int, runs: list[tuple[str, bool]], out: str) -> None:
    """Each (checkpoint, expert parallel) of ``runs``: this rank's heads, routed experts held (of the
    first expert layer, if any) and logits, saved to ``out.<rank>``."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    try:
        results = []
        for path, expert_parallel in runs:
            model = load_model(Path(path), quantization="auto", tp=TensorParallel(rank, size, expert_parallel))
            moe = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, FusedMoE)]
            held = list(moe[0].experts) if moe else []
            results.append((model.model.layers[0].self_attn.num_heads, held, logits(model, PROMPT)))
        torch.save(results, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_two_tensor_or_expert_parallel_ranks_give_the_whole_models_logits(
    fp8_checkpoint: tuple[Path, Any, dict[str, torch.Tensor]], moe_checkpoint: tuple[Path, Any], tmp_path: Path
) -> None:
    """Each rank holds half the heads (q, kv_b and o projections) and the whole latent path and cache:
    float32 checkpoints with and without q_lora, and the FP8 one; the expert layers' checkpoint with
    every routed expert split (tensor parallel) and with half the experts whole on each rank (expert
    parallel), the shared expert split either way; in one group of ranks (each loads the checkpoint)."""
    runs = [(str(fp8_checkpoint[0]), False)]
    for q_lora in (True, False):
        runs.append((str(tmp_path / f"q_lora-{q_lora}"), False))
        deepseek_v3(q_lora=q_lora).save_pretrained(runs[-1][0], safe_serialization=True)
    runs += [(str(moe_checkpoint[0]), False), (str(moe_checkpoint[0]), True)]
    out = tmp_path / "logits"
    run_ranks(_rank_logits, (2, _free_port(), runs, str(out)), 2)
    ranks = [torch.load(f"{out}.{rank}") for rank in range(2)]
    for run, (path, expert_parallel) in enumerate(runs):
        whole = logits(load_model(Path(path), quantization="auto"), PROMPT)
        for rank, results in enumerate(ranks):
            heads, held, sharded = results[run]
            assert heads == 2
            if expert_parallel:
                assert held == [str(e) for e in range(4 * rank, 4 * rank + 4)]
            elif path == str(moe_checkpoint[0]):
                assert held == [str(e) for e in range(8)]
            torch.testing.assert_close(sharded, whole, atol=1e-4, rtol=0)
