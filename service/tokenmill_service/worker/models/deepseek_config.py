"""What DeepSeek-V3's spec declares (deepseek_v3.py has its module): its attention sizes (``MLADims``), how
it reads its config.json and llama.cpp's ``deepseek2`` GGUF keys, its tensor names and linear layers (its
multi-token-prediction layers' too), what it caches per token, and the checkpoints it refuses."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenmill_service.worker.layers.fused_moe import GroupedTopK
from tokenmill_service.worker.models.config import ModelConfig
from tokenmill_service.worker.models.deepseek_mtp import mtp_layer_count, mtp_prefix
from tokenmill_service.worker.models.hf_loader import rope_params, rope_type
from tokenmill_service.worker.models.moe import GGUF_MOE_NAMES, moe_settings, set_moe
from tokenmill_service.worker.models.spec import GGUFField
from tokenmill_service.worker.models.yarn import YARN_TYPES, Yarn, hf_yarn

# llama.cpp's expert_gating_func values (gguf's ExpertGatingFuncType).
GGUF_GATING = {1: "softmax", 2: "sigmoid", 3: "sqrtsoftplus"}
# llama.cpp converts DeepSeek-V2/V3 as "deepseek2" (convert_hf_to_gguf.py's DeepseekV2Model): its names.
GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    # Newer converters split kv_b into its key half (each head's transposed) and its value half.
    "attn_k_b": "self_attn.k_b_proj",
    "attn_v_b": "self_attn.v_b_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    **GGUF_MOE_NAMES,
    "exp_probs_b": "mlp.gate.e_score_correction",  # its ".bias": transformers' e_score_correction_bias
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}


@dataclass(frozen=True, slots=True)
class MLADims:
    """The attention sizes of a DeepSeek config (``ModelConfig.extra["mla"]``)."""

    q_lora_rank: int  # 0: queries straight from q_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def mla_dims(config: ModelConfig) -> MLADims:
    dims = config.extra["mla"]
    assert isinstance(dims, MLADims)
    return dims


def read_hf(raw: dict[str, Any], hf_architecture: str, config: ModelConfig) -> None:
    q_lora = raw.get("q_lora_rank")
    dims = MLADims(
        q_lora_rank=int(q_lora or 0),
        kv_lora_rank=int(raw.get("kv_lora_rank", 512)),
        qk_nope_head_dim=int(raw.get("qk_nope_head_dim", 128)),
        qk_rope_head_dim=int(raw.get("qk_rope_head_dim", 64)),
        v_head_dim=int(raw.get("v_head_dim", 128)),
        rope_interleave=bool(raw.get("rope_interleave", True)),
    )
    if dims.qk_rope_head_dim % 2:
        raise ValueError(f"qk_rope_head_dim {dims.qk_rope_head_dim} is odd: rotary rotates pairs")
    config.extra["mla"] = dims
    config.extra["mtp_layers"] = int(raw.get("num_nextn_predict_layers") or 0)
    config.head_dim = dims.qk_rope_head_dim  # as transformers' config: the rotated part of a head
    params = rope_params(raw)
    if rope_type(params) in YARN_TYPES:
        config.extra["yarn"] = hf_yarn(params, raw, config)
    routed = int(raw.get("n_routed_experts") or 0)
    first_dense = raw.get("first_k_dense_replace")
    # transformers' DeepseekV3Config defaults (DeepSeek-V3's own values) where the file says nothing.
    _set_experts(
        config,
        routed=routed,
        first_dense=config.num_layers if not routed or first_dense is None else int(first_dense),
        per_token=int(raw.get("num_experts_per_tok") or 8),
        width=int(raw.get("moe_intermediate_size") or 2048),
        shared=int(raw.get("n_shared_experts") or 0),
        renormalize=bool(raw.get("norm_topk_prob", True)),
        routing=GroupedTopK(
            int(raw.get("n_group") or 1),
            int(raw.get("topk_group") or 1),
            float(raw.get("routed_scaling_factor", 2.5)),
        ),
        scoring=str(raw.get("scoring_func") or "sigmoid"),
    )


def _set_experts(
    config: ModelConfig,
    routed: int,
    first_dense: int,
    per_token: int,
    width: int,
    shared: int,
    renormalize: bool,
    routing: GroupedTopK,
    scoring: str,
) -> None:
    """The routed experts' settings (``set_moe``'s, where any layer has experts) and DeepSeek's own:
    ``moe_routing``, ``shared_expert_width``, ``moe_scoring`` (the score function, only sigmoid served)."""
    first_dense = min(first_dense, config.num_layers)
    config.extra |= {
        "first_k_dense_replace": first_dense,
        "n_routed_experts": routed,
        "moe_routing": routing,
        "shared_expert_width": width * shared,
        "moe_scoring": scoring,
    }
    if first_dense < config.num_layers:
        set_moe(config, routed, per_token, width, renormalize, range(first_dense, config.num_layers))


def read_gguf(field: GGUFField, gguf_architecture: str, config: ModelConfig) -> None:
    """llama.cpp's deepseek2 keys: it writes MLA as one key/value head of kv_lora_rank + rope dims
    (``key_length``), the per-head sizes as ``key_length_mla`` / ``value_length_mla`` (older files:
    ``key_length`` / ``value_length`` are the per-head ones), and DeepSeek's rope always interleaved."""

    def key(name: str) -> Any:
        return field(f"{gguf_architecture}.{name}")

    kv_lora, rope = int(key("attention.kv_lora_rank")), int(key("rope.dimension_count"))
    if key("attention.key_length_mla") is not None:
        qk_head, v_head = int(key("attention.key_length_mla")), int(key("attention.value_length_mla"))
    else:
        qk_head, v_head = config.head_dim, int(key("attention.value_length"))
    config.extra["mla"] = MLADims(int(key("attention.q_lora_rank") or 0), kv_lora, qk_head - rope, rope, v_head, True)
    config.head_dim = rope
    config.num_kv_heads = config.num_heads
    scaling = key("rope.scaling.type")
    if scaling == "yarn":
        # llama.cpp keeps 0.1 * mscale_all_dim; DeepSeek's configs have mscale equal to it.
        mscale = float(key("rope.scaling.yarn_log_multiplier") or 0) / 0.1
        attention_factor = key("rope.scaling.yarn_attn_factor")
        config.extra["yarn"] = Yarn(
            factor=float(key("rope.scaling.factor")),
            original_max_positions=int(key("rope.scaling.original_context_length")),
            beta_fast=float(key("rope.scaling.yarn_beta_fast") or 32),
            beta_slow=float(key("rope.scaling.yarn_beta_slow") or 1),
            mscale=mscale,
            mscale_all_dim=mscale,
            attention_factor=None if attention_factor is None else float(attention_factor),
        )
    elif scaling not in (None, "none"):
        raise ValueError(f"RoPE scaling type {scaling!r} is not supported (supported: yarn)")
    experts = int(key("expert_count") or 0)
    dense = key("leading_dense_block_count")
    norm, scale, gating = key("expert_weights_norm"), key("expert_weights_scale"), key("expert_gating_func")
    # As llama.cpp reads deepseek2: no gating function written is softmax (DeepSeek-V2's), no
    # scale 1, no norm false, no groups one group.
    _set_experts(
        config,
        routed=experts,
        first_dense=config.num_layers if not experts else int(dense or 0),
        per_token=int(key("expert_used_count") or 0),
        width=int(key("expert_feed_forward_length") or 0),
        shared=int(key("expert_shared_count") or 0),
        renormalize=bool(norm) if norm is not None else False,
        routing=GroupedTopK(
            int(key("expert_group_count") or 1),
            int(key("expert_group_used_count") or 1),
            float(scale) if scale is not None else 1.0,
        ),
        scoring=GGUF_GATING.get(int(gating), f"gating function {gating}") if gating is not None else "softmax",
    )


def unserved_reason(config: ModelConfig) -> str | None:
    """Why this checkpoint cannot be served (the plan refuses it), or None: routing other than
    DeepSeek-V3's sigmoid one, or groups that cannot hold a token's experts."""
    if "num_experts" not in config.extra:
        return None  # every layer dense
    scoring = config.extra["moe_scoring"]
    if scoring != "sigmoid":
        return (
            f"this DeepSeek checkpoint routes its experts by {scoring} scores; only DeepSeek-V3's sigmoid "
            "routing (with its score-correction bias and expert groups) is served"
        )
    experts, per_token, _, _, _ = moe_settings(config)
    routing: GroupedTopK = config.extra["moe_routing"]  # type: ignore[assignment]
    try:
        routing.check(experts, per_token)
    except ValueError as e:
        return f"this DeepSeek-V3 checkpoint's routing cannot be served: {e}"
    return None


def latent_stack_gap(config: ModelConfig) -> str | None:
    """Why the native decoder stack cannot run this checkpoint's latent attention (the plan's
    ``native_stack_missing``), or None: latent_attention.cpp takes latent, rotary and value dims in 16s
    (otherwise the layers' attention is the reference's)."""
    d = mla_dims(config)
    if any(n % 16 for n in (d.kv_lora_rank, d.qk_rope_head_dim, d.v_head_dim)):
        return (
            f"native latent attention takes latent, rotary and value dims in 16s, not "
            f"{d.kv_lora_rank}, {d.qk_rope_head_dim}, {d.v_head_dim}"
        )
    return None


def kv_cache_values_per_token(config: ModelConfig, tensor_parallel: int = 1) -> tuple[int, int]:
    """Values one token of context caches on a rank: the latent layout's (latent + rotary key per
    layer, every rank all of it), and an equivalent per-head cache's (each of the rank's heads a
    key of qk_nope + qk_rope dims and a value of v_head_dim), for comparison."""
    d = mla_dims(config)
    heads = config.num_heads // tensor_parallel
    latent = config.num_layers * (d.kv_lora_rank + d.qk_rope_head_dim)
    per_head = config.num_layers * heads * (d.qk_head_dim + d.v_head_dim)
    return latent, per_head


def linear_prefixes(config: ModelConfig) -> list[str]:
    prefixes = []
    for i in range(config.num_layers):
        prefixes += _layer_linear_prefixes(config, f"model.layers.{i}", i)
    return [*prefixes, "lm_head"]


def mtp_linear_prefixes(config: ModelConfig) -> list[str]:
    """The linear layers of the multi-token-prediction layer served (``attach_mtp``)."""
    prefixes = []
    for i in range(min(1, mtp_layer_count(config))):
        prefix = mtp_prefix(i)
        block = _layer_linear_prefixes(config, f"{prefix}.block", config.num_layers + i)
        prefixes += [f"{prefix}.eh_proj", *block, f"{prefix}.shared_head.head"]
    return prefixes


def _layer_linear_prefixes(config: ModelConfig, layer: str, index: int) -> list[str]:
    q = ("q_a_proj", "q_b_proj") if mla_dims(config).q_lora_rank else ("q_proj",)
    prefixes = [f"{layer}.self_attn.{leaf}" for leaf in (*q, "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")]
    first_moe = int(config.extra["first_k_dense_replace"])  # type: ignore[call-overload]
    experts = int(config.extra.get("num_experts", 0))  # type: ignore[call-overload]
    shared = int(config.extra["shared_expert_width"])  # type: ignore[call-overload]
    if index < first_moe or not experts:
        return [*prefixes, f"{layer}.mlp.gate_up_proj", f"{layer}.mlp.down_proj"]
    prefixes.append(f"{layer}.mlp.gate")
    for e in range(experts):
        prefixes += [f"{layer}.mlp.experts.{e}.gate_up_proj", f"{layer}.mlp.experts.{e}.down_proj"]
    if shared:
        prefixes += [f"{layer}.mlp.shared_experts.gate_up_proj", f"{layer}.mlp.shared_experts.down_proj"]
    return prefixes
