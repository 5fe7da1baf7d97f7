"""Tiny random DeepSeek-V3 checkpoints made from a transformers config (all layers dense, or the first
dense and the others routed and shared experts), as safetensors
in float32 and FP8 block-quantized the way DeepSeek-V3's own files are (``weight`` e4m3 +
``weight_scale_inv``, a float32 scale per block), with the dequantized weights the FP8 file holds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

# With q_lora (the low-rank query path), YaRN with DeepSeek's mscale correction and interleaved rope;
# without q_lora, plain rope on halves. qk_rope_head_dim 64: a head the native ops take.
MLA = dict(  # noqa: C408 - keyword names as in the transformers config
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=64,
    v_head_dim=32,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    # Routed experts configured, but every layer dense (first_k_dense_replace = the layer count).
    n_routed_experts=8,
    n_group=2,
    topk_group=1,
    num_experts_per_tok=2,
    first_k_dense_replace=2,
)
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 0.8,
}


# The mixture-of-experts model: 3 layers, the first dense; 8 routed experts in 2 groups (the tokens'
# experts from 1 of them), 2 a token, renormalized and scaled; 1 shared expert.
MOE = dict(  # noqa: C408 - keyword names as in the transformers config
    num_hidden_layers=3,
    first_k_dense_replace=1,
    moe_intermediate_size=32,
    n_shared_experts=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
)


def deepseek_v3(
    q_lora: bool,
    vocab_size: int = 96,
    seed: int = 0,
    yarn: dict[str, Any] | None = None,
    moe: bool = False,
    **overrides: Any,
) -> Any:
    """A random transformers DeepseekV3ForCausalLM (float32, eval), every weight away from its init
    (``yarn``: other YaRN parameters for the q_lora model; ``moe``: with expert layers, ``MOE``;
    ``overrides``: other config values)."""
    import transformers

    if q_lora:
        extra: dict[str, Any] = {"q_lora_rank": 32, "rope_parameters": yarn or YARN, "rope_interleave": True}
    else:
        extra = {"q_lora_rank": None, "rope_interleave": False}
    config = transformers.DeepseekV3Config(vocab_size=vocab_size, **(MLA | (MOE if moe else {}) | extra | overrides))
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(config)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator) * 0.1
            param.copy_(noise + 1.0 if "norm" in name else noise * 2)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # the choice shifted: some experts favoured
                buffer.copy_(torch.randn(buffer.shape, generator=generator) * 0.2)
    return model.eval()


def is_fp8_target(name: str, tensor: torch.Tensor) -> bool:
    """The tensors DeepSeek-V3 stores in FP8: every projection of the layers (not norms, embeddings, head)."""
    return tensor.dim() == 2 and ".layers." in name and name.endswith("proj.weight") or "kv_a_proj_with_mqa" in name


def fp8_block_quantize(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values, float32 scale_inv per block) with amax / 448 scales, DeepSeek's recipe."""
    rows, cols = w.shape
    nr, nc = -(-rows // block), -(-cols // block)
    padded = torch.zeros(nr * block, nc * block)
    padded[:rows, :cols] = w
    blocks = padded.view(nr, block, nc, block)
    scale = (blocks.abs().amax(dim=(1, 3)) / 448.0).clamp(min=1e-12)
    q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).view(nr * block, nc * block)
    return q[:rows, :cols].contiguous(), scale.float().contiguous()


def fp8_dequantize(q: torch.Tensor, scale_inv: torch.Tensor, block: int) -> torch.Tensor:
    """The reference dequantization: w = fp8 value * scale_inv of its block."""
    rows, cols = q.shape
    scales = scale_inv.repeat_interleave(block, 0).repeat_interleave(block, 1)[:rows, :cols]
    return q.float() * scales


def save_fp8(model: Any, directory: Path, block: int) -> dict[str, torch.Tensor]:
    """Save ``model`` FP8 block-quantized as DeepSeek-V3 does; returns the tensors it stands for, by
    the file's names (the projections dequantized, the rest as they are; each expert on its own)."""
    model.save_pretrained(directory, safe_serialization=True)
    return quantize_fp8(directory, block)


def quantize_fp8(directory: Path, block: int) -> dict[str, torch.Tensor]:
    """FP8 block-quantize the checkpoint at ``directory`` in place (``save_fp8``)."""
    from safetensors.torch import load_file, save_file

    tensors, dequantized = {}, {}
    for name, w in load_file(directory / "model.safetensors").items():
        if is_fp8_target(name, w):
            q, scale_inv = fp8_block_quantize(w, block)
            tensors[name], tensors[name + "_scale_inv"] = q, scale_inv
            dequantized[name] = fp8_dequantize(q, scale_inv, block)
        else:
            tensors[name] = dequantized[name] = w.contiguous()
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [block, block],
    }
    (directory / "config.json").write_text(json.dumps(config))
    return dequantized


# llama.cpp's deepseek2 tensor names of a layer's parts (convert_hf_to_gguf.py, gguf's TENSOR_NAMES).
GGUF_PARTS = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.q_a_proj": "attn_q_a",
    "self_attn.q_a_layernorm": "attn_q_a_norm",
    "self_attn.q_b_proj": "attn_q_b",
    "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
    "self_attn.kv_a_layernorm": "attn_kv_a_norm",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
    "mlp.shared_experts.up_proj": "ffn_up_shexp",
    "mlp.shared_experts.down_proj": "ffn_down_shexp",
}
GGUF_GLOBALS = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}


def write_deepseek2_gguf(model: Any, path: Path) -> None:
    """A float32 GGUF of ``model`` as llama.cpp's converter (DeepseekV2Model) writes it: MLA as one
    key/value head of kv_lora_rank + rope dims, the per-head sizes as the *_mla keys, YaRN's
    mscale_all_dim as 0.1 x it, kv_b_proj split into k_b (each head transposed) and v_b; the routing's
    keys (expert_used/group counts, weights scale and norm, sigmoid gating), the experts stacked
    (``ffn_{gate,up,down}_exps``) and the score-correction bias as ``exp_probs_b.bias``."""
    import gguf

    cfg = model.config
    w = gguf.GGUFWriter(str(path), "deepseek2")
    w.add_name("tiny-deepseek")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(1)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_leading_dense_block_count(cfg.first_k_dense_replace)
    w.add_vocab_size(cfg.vocab_size)
    if cfg.q_lora_rank:
        w.add_q_lora_rank(cfg.q_lora_rank)
    w.add_kv_lora_rank(cfg.kv_lora_rank)
    w.add_key_length(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    w.add_value_length(cfg.kv_lora_rank)
    w.add_key_length_mla(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    w.add_value_length_mla(cfg.v_head_dim)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_count(cfg.n_routed_experts)
    w.add_expert_shared_count(cfg.n_shared_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_group_count(cfg.n_group)
    w.add_expert_group_used_count(cfg.topk_group)
    w.add_expert_weights_scale(cfg.routed_scaling_factor)
    if cfg.norm_topk_prob:
        w.add_expert_weights_norm(True)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_rope_dimension_count(cfg.qk_rope_head_dim)
    rope = cfg.rope_parameters
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
        w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    heads, nope, v = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    for name, tensor in model.state_dict().items():
        data = tensor.detach().float()
        if name == "lm_head.weight":
            w.add_tensor("output.weight", data.numpy())
            continue
        if name in GGUF_GLOBALS:
            w.add_tensor(GGUF_GLOBALS[name], data.numpy())
            continue
        _, _, layer, rest = name.split(".", 3)  # model.layers.N.<part>.weight
        part = rest.removesuffix(".weight")
        if part == "mlp.experts.gate_up_proj":  # [experts, 2 * width, hidden]: gate rows, then up
            gate, up = data.chunk(2, dim=1)
            w.add_tensor(f"blk.{layer}.ffn_gate_exps.weight", gate.contiguous().numpy())
            w.add_tensor(f"blk.{layer}.ffn_up_exps.weight", up.contiguous().numpy())
            continue
        if part == "mlp.experts.down_proj":
            w.add_tensor(f"blk.{layer}.ffn_down_exps.weight", data.contiguous().numpy())
            continue
        if part == "mlp.gate.e_score_correction_bias":
            w.add_tensor(f"blk.{layer}.exp_probs_b.bias", data.numpy())
            continue
        if part == "self_attn.kv_b_proj":
            k_b, v_b = data.view(heads, nope + v, -1).split([nope, v], dim=1)
            w.add_tensor(f"blk.{layer}.attn_k_b.weight", k_b.transpose(1, 2).contiguous().numpy())
            w.add_tensor(f"blk.{layer}.attn_v_b.weight", v_b.contiguous().numpy())
            continue
        w.add_tensor(f"blk.{layer}.{GGUF_PARTS[part]}.weight", data.numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def add_mtp_layer(directory: Path, seed: int = 5, predicting: bool = False) -> None:
    """Give the checkpoint at ``directory`` one multi-token-prediction layer as DeepSeek-V3's files hold it
    (``model.layers.<num_hidden_layers>``: ``enorm``, ``hnorm``, ``eh_proj``, a decoder block shaped like the
    last decoder layer, ``shared_head.norm`` / ``.head``, its copy of ``embed_tokens``), random.

    ``predicting``: instead, every attention output and MLP projection (the decoder's and the block's) is
    zeroed, so that the model's next token depends on the last token alone, and the MTP layer is made to
    compute that same function of the token it reads (``eh_proj`` passes the token's half through, the
    head is the model's): its drafts are what the model samples next."""
    from safetensors.torch import load_file, save_file

    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    config["num_nextn_predict_layers"] = 1
    config_path.write_text(json.dumps(config))
    layers = int(config["num_hidden_layers"])
    hidden = int(config["hidden_size"])
    tensors = load_file(directory / "model.safetensors")
    generator = torch.Generator().manual_seed(seed)
    mtp = f"model.layers.{layers}."
    for name in [n for n in tensors if n.startswith(f"model.layers.{layers - 1}.")]:
        shape = tensors[name].shape
        noise = torch.randn(shape, generator=generator) * 0.1
        tensors[mtp + name.split(".", 3)[3]] = noise + 1.0 if "norm" in name else noise * 2
    tensors[mtp + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    for part in ("enorm", "hnorm", "shared_head.norm"):
        tensors[f"{mtp}{part}.weight"] = torch.randn(hidden, generator=generator) * 0.1 + 1.0
    tensors[mtp + "eh_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=generator) * 0.2
    tensors[mtp + "shared_head.head.weight"] = torch.randn(tensors["lm_head.weight"].shape, generator=generator)
    if predicting:
        for name in tensors:
            if "o_proj" in name or "down_proj" in name:
                tensors[name] = torch.zeros_like(tensors[name])
        tensors[mtp + "enorm.weight"] = torch.ones(hidden)
        tensors[mtp + "eh_proj.weight"] = torch.cat((torch.eye(hidden), torch.zeros(hidden, hidden)), dim=1)
        tensors[mtp + "shared_head.norm.weight"] = tensors["model.norm.weight"].clone()
        tensors[mtp + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
