"""gpt-oss: a tiny random transformers checkpoint (2 layers, one sliding-window of 8 keys and one full,
4 experts top-2, YaRN, attention sinks, biases everywhere, the clamped SwiGLU) served as transformers
computes it: logits and prompt logprobs within 1e-4 at float32 with dense weights past five windows,
the same greedy tokens, the triton backend's logits (its interpreter), and a prompt bitwise the same
alone and in a crowd, prefilled and decoded (float32: a dense checkpoint's default bfloat16 product
promises no batch invariance, README.md). Its experts in MXFP4, as openai's safetensors and as a
llama.cpp GGUF hold them: the transformers logits at --quantization none, and in the default
configuration (exact Q8_0, native kernels) within their bounds and batch-invariant. Two
expert-parallel ranks: tests/engine/test_moe_families.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from safetensors.torch import save_file

from tests.engine.gpt_oss_checkpoint import PROMPT, ROPE, WINDOW, hf_gpt_oss
from tests.engine.invariance import assert_alone_equals_crowd, assert_prefill_equals_decode
from tests.engine.test_moe_families import greedy, hf_logits
from tests.triton_setup import DEVICE  # before anything imports triton: its interpreter without a GPU
from tokenmill_service.contract.plan import LoadOptions
from tokenmill_service.worker.engine.model_runner import forward_prompt
from tokenmill_service.worker.layers.fused_moe import FusedMoE
from tokenmill_service.worker.layers.quant.mxfp4 import dequantize_openai
from tokenmill_service.worker.loader import load, load_model
from tokenmill_service.worker.models.checkpoint import open_checkpoint

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    model = hf_gpt_oss()
    directory = tmp_path_factory.mktemp("tiny-gpt-oss")
    model.save_pretrained(directory, safe_serialization=True)
    return directory, model


@torch.inference_mode()
def test_logits_and_prompt_logprobs_are_the_transformers_ones(checkpoint: tuple[Path, Any]) -> None:
    directory, hf = checkpoint
    model = load_model(directory, dtype=torch.float32, quantization="none")
    assert model.config.architecture == "gpt_oss" and model.plan.ops.value == "native"
    assert [layer.self_attn.params.window for layer in model.model.layers] == [WINDOW, None]
    assert all(isinstance(layer.mlp, FusedMoE) for layer in model.model.layers)
    actual = model.compute_logits(forward_prompt(model, PROMPT))
    expected = hf_logits(hf, PROMPT)
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(torch.log_softmax(actual, -1), torch.log_softmax(expected, -1), atol=1e-4, rtol=0)
    # Its layers (sinks, windows, biases, YaRN) run in the native decoder stack; its experts (biases,
    # clamped SwiGLU) are one native call a layer.
    assert model.plan.executor.value == "native-stack", model.plan.executor
    assert model.plan.experts is not None and model.plan.experts.value == "native", model.plan.experts
    assert all(layer.mlp.one_call and layer.mlp.native() is not None for layer in model.model.layers)


def test_greedy_tokens_are_the_transformers_ones(checkpoint: tuple[Path, Any]) -> None:
    directory, hf = checkpoint
    ids = list(PROMPT[:12])
    for _ in range(5):
        ids.append(int(hf_logits(hf, ids)[-1].argmax()))
    model = load_model(directory, dtype=torch.float32, quantization="none")
    assert greedy(model, PROMPT[:12], 5) == ids[12:]


def test_a_prompt_is_bitwise_the_same_alone_and_in_a_crowd_prefilled_and_decoded(checkpoint: tuple[Path, Any]) -> None:
    model = load_model(checkpoint[0])
    assert model.plan.executor.value == "native-stack", model.plan.executor  # the default configuration's
    assert_alone_equals_crowd(model, PROMPT)
    assert_prefill_equals_decode(model, PROMPT[:21], 9)  # the decoded steps span two windows


@torch.inference_mode()
def test_the_triton_backend_gives_the_transformers_logits(checkpoint: tuple[Path, Any]) -> None:
    """Sinks, the window and the rest of the model as triton kernels (the interpreter on a CPU)."""
    directory, hf = checkpoint
    model = load_model(directory, dtype=torch.float32, quantization="none", backend="triton", device=DEVICE.type)
    assert model.plan.ops.value == "triton"
    actual = model.compute_logits(forward_prompt(model, PROMPT[:20])).cpu()
    torch.testing.assert_close(actual, hf_logits(hf, PROMPT[:20]), atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def mxfp4_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """As openai ships gpt-oss: the experts' matrices MXFP4 (``<name>_blocks`` / ``<name>_scales``,
    [experts, out, in]), quantization_config mxfp4; the reference is transformers with those weights dense."""
    hf = hf_gpt_oss()
    directory = tmp_path_factory.mktemp("tiny-gpt-oss-mxfp4")
    gen = torch.Generator().manual_seed(3)
    tensors = {name: t.contiguous() for name, t in hf.state_dict().items()}
    for layer, projection in ((0, "gate_up_proj"), (0, "down_proj"), (1, "gate_up_proj"), (1, "down_proj")):
        name = f"model.layers.{layer}.mlp.experts.{projection}"
        experts, inputs, outputs = tensors.pop(name).shape
        blocks = torch.randint(0, 256, (experts, outputs, inputs // 32, 16), generator=gen, dtype=torch.uint8)
        scales = torch.randint(122, 126, (experts, outputs, inputs // 32), generator=gen, dtype=torch.uint8)
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
        with torch.no_grad():
            getattr(hf.model.layers[layer].mlp.experts, projection).copy_(
                dequantize_openai(blocks, scales).transpose(1, 2)
            )
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    hf.config.save_pretrained(directory)
    config = json.loads((directory / "config.json").read_text())
    config["architectures"] = ["GptOssForCausalLM"]
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (directory / "config.json").write_text(json.dumps(config))
    return directory, hf


@torch.inference_mode()
def test_mxfp4_experts_dequantized_give_the_transformers_logits(mxfp4_checkpoint: tuple[Path, Any]) -> None:
    directory, hf = mxfp4_checkpoint
    model = load_model(directory, dtype=torch.float32, quantization="none")
    actual = model.compute_logits(forward_prompt(model, PROMPT))
    torch.testing.assert_close(actual, hf_logits(hf, PROMPT), atol=1e-4, rtol=0)


@torch.inference_mode()
def test_mxfp4_experts_are_served_natively_as_stored_by_default(mxfp4_checkpoint: tuple[Path, Any]) -> None:
    """The default configuration multiplies the experts' MXFP4 blocks as stored: within the native
    kernels' bounds of transformers, batch-invariant."""
    directory, hf = mxfp4_checkpoint
    served = load(LoadOptions(model=str(directory)))
    methods = {choice.method for prefix, choice in served.plan.layers.items() if ".experts." in prefix}
    assert methods <= {"gguf", "gguf-vnni"}, served.plan.layers
    assert served.plan.experts is not None and served.plan.experts.value == "native", served.plan.experts
    assert any("MXFP4" in reason and "as Q8_0" not in reason for reason in served.plan.quant_reasons.values()), (
        served.plan.quant_reasons
    )
    got = torch.log_softmax(served.compute_logits(forward_prompt(served, PROMPT)), -1)
    want = torch.log_softmax(hf_logits(hf, PROMPT), -1)
    targets = torch.tensor(PROMPT[1:])[:, None]
    error = (got[:-1].gather(1, targets) - want[:-1].gather(1, targets)).abs()
    assert error.mean() < 1e-3 and error.max() < 1e-2, (error.mean().item(), error.max().item())
    assert_alone_equals_crowd(served, PROMPT)


def write_gpt_oss_gguf(hf: Any, path: Path) -> None:
    """A GGUF as llama.cpp's converter (conversion/gpt_oss.py) writes gpt-oss: gate and up de-interleaved
    into ``ffn_gate_exps`` / ``ffn_up_exps`` [experts, width, hidden] with their biases, ``ffn_down_exps``,
    ``attn_sinks``, ``post_attention_norm``, the router as ``ffn_gate_inp`` with a bias, YaRN and the
    window in the metadata; the experts' matrices MXFP4 (gguf's own quantizer), the rest float32. The
    transformers model takes the MXFP4 weights' exact values, so it stays the reference."""
    cfg = hf.config
    writer = gguf.GGUFWriter(str(path), "gpt-oss")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_freq_base(ROPE["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_expert_count(cfg.num_local_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    writer.add_expert_feed_forward_length(cfg.intermediate_size)
    writer.add_sliding_window(cfg.sliding_window)
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(ROPE["factor"])
    writer.add_rope_scaling_orig_ctx_len(ROPE["original_max_position_embeddings"])
    writer.add_rope_scaling_yarn_beta_fast(ROPE["beta_fast"])
    writer.add_rope_scaling_yarn_beta_slow(ROPE["beta_slow"])
    state = {name: t.detach().float() for name, t in hf.state_dict().items()}
    names = {
        "input_layernorm.weight": "attn_norm.weight",
        "post_attention_layernorm.weight": "post_attention_norm.weight",
        "self_attn.sinks": "attn_sinks.weight",
        "mlp.router.weight": "ffn_gate_inp.weight",
        "mlp.router.bias": "ffn_gate_inp.bias",
        **{
            f"self_attn.{p}_proj.{k}": f"attn_{g}.{k}"
            for p, g in zip("qkvo", ["q", "k", "v", "output"])
            for k in ("weight", "bias")
        },
    }
    tensors = {
        "token_embd.weight": state["model.embed_tokens.weight"],
        "output_norm.weight": state["model.norm.weight"],
    }
    tensors["output.weight"] = state["lm_head.weight"]
    for i, layer in enumerate(hf.model.layers):
        for hf_part, gguf_part in names.items():
            tensors[f"blk.{i}.{gguf_part}"] = state[f"model.layers.{i}.{hf_part}"]
        experts = layer.mlp.experts
        gate_up = experts.gate_up_proj.detach().transpose(1, 2)  # [experts, 2 * width, hidden], interleaved
        bias = experts.gate_up_proj_bias.detach()
        matrices = {
            "gate": gate_up[:, 0::2],
            "up": gate_up[:, 1::2],
            "down": experts.down_proj.detach().transpose(1, 2),
        }
        for part, matrix in matrices.items():
            raw = gguf.quants.quantize(matrix.contiguous().numpy(), QType.MXFP4)
            exact = torch.from_numpy(gguf.quants.dequantize(raw, QType.MXFP4)).reshape(matrix.shape)
            matrix.copy_(exact)  # into the transformers model's own tensors (views of them)
            writer.add_tensor(f"blk.{i}.ffn_{part}_exps.weight", raw, raw_dtype=QType.MXFP4)
        tensors[f"blk.{i}.ffn_gate_exps.bias"] = bias[:, 0::2]
        tensors[f"blk.{i}.ffn_up_exps.bias"] = bias[:, 1::2]
        tensors[f"blk.{i}.ffn_down_exps.bias"] = experts.down_proj_bias.detach()
    for name, data in tensors.items():
        writer.add_tensor(name, data.float().contiguous().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@torch.inference_mode()
def test_a_llama_cpp_gguf_with_mxfp4_experts_gives_the_transformers_logits(tmp_path: Path) -> None:
    hf = hf_gpt_oss()
    path = tmp_path / "tiny-gpt-oss.gguf"
    write_gpt_oss_gguf(hf, path)
    assert open_checkpoint(path).tensor_types["model.layers.1.mlp.experts.3.up_proj.weight"] == QType.MXFP4
    model = load_model(path, dtype=torch.float32, quantization="none")
    assert model.config.architecture == "gpt_oss"
    assert [layer.self_attn.params.window for layer in model.model.layers] == [WINDOW, None]
    expected = hf_logits(hf, PROMPT)
    torch.testing.assert_close(model.compute_logits(forward_prompt(model, PROMPT)), expected, atol=1e-4, rtol=0)
    served = load(LoadOptions(model=str(path)))  # the default: the MXFP4 experts as stored, natively
    assert any("MXFP4" in reason and "as Q8_0" not in reason for reason in served.plan.quant_reasons.values()), (
        served.plan.quant_reasons
    )
    got = torch.log_softmax(served.compute_logits(forward_prompt(served, PROMPT)), -1)
    assert (got - torch.log_softmax(expected, -1)).abs().max() < 1e-2
