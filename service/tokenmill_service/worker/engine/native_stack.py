"""The native decoder stack as an executor: a decoder's layers and final norm described to
``worker/kernels/cpu/decoder_stack.py`` (its kernels' entry points, weights, norms and rotary tables), run
as one native call a step with the bits of the model's own loop (tests/kernels/test_decoder_stack.py).

The load plan decides whether a model runs this way (``worker/plan/executor.py``); this only describes a model
the plan chose it for, from what its family's spec states of its layers (``model.facts``, worker/models/spec.py's
``Facts``) and the layers' own numbers:

- the q/k norms (``facts.qk_norm``: none, over the whole projection, per head); the MLP's activation
  (``facts.activation``: SiLU, or Gemma's GeGLU); the norms' placement (``facts.norms``: Gemma's sandwich
  norms hand the stack their norms of attention's and the MLP's outputs); attention's soft cap (Gemma 2's)
  and sinks (gpt-oss's) where the facts say the family has them;
- each layer's sliding window, a projection's bias, the residual multiplier (Granite's), a rotary that turns
  only the first dims of each head (Phi-4-mini's) and a layer's own rotary tables (Gemma 3's global ones);
- a mixture-of-experts layer's router and its experts' native call (``FusedMoE.native``);
- with latent attention (``facts.latent_attention``: DeepSeek-V3's), the query projection (q_proj, or q_a_proj,
  its norm and q_b_proj), kv_a_proj_with_mqa and its latent's norm, kv_b_proj's weight as the attention
  absorbed it, the rotary tables and whether their dims are interleaved; grouped routing (``GroupedTopK`` and
  the score-correction bias), the shared experts' dense MLP, the first layers' dense MLP.

A model with LoRA adapter slots (``--max-loras``) hands each linear layer's slots to the stack, and every step
the tokens of each slot in use. The embeddings (Gemma's and Granite's scaled) and the logits (soft caps,
Granite's scaling) stay the model's own.
"""

from __future__ import annotations

from typing import Any

import torch

from tokenmill_service.worker.kernels import decoder_stack
from tokenmill_service.worker.kernels.attention_metadata import AttentionMetadata
from tokenmill_service.worker.layers.fused_moe import FusedMoE


def _linear(lin: Any) -> decoder_stack.LinearSpec:
    assert lin.quant.native_kernel is not None  # the plan chose the stack: every projection has one
    lora = None
    if lin.lora is not None:
        stack = lin.lora.stack
        lora = (stack.a, stack.bt, stack.ranks, lin.lora.part_rows)
    weights, fmt = lin.quant.native_operands(lin)
    bias = None if lin.bias is None else lin.bias.detach()
    return decoder_stack.LinearSpec(lin.quant.native_kernel, weights, fmt, lin.out_features, lora, bias)


def _moe(mlp: FusedMoE) -> decoder_stack.MoESpec:
    """A mixture-of-experts layer as the stack runs it: its routing (softmax top-k, the top-k logits, or
    DeepSeek-V3's grouped sigmoid with its score-correction bias), every expert native."""
    experts = mlp.native()  # the plan runs the stack only where they run in one call
    score_bias = None if mlp.grouped is None else mlp.score_bias
    return decoder_stack.MoESpec(
        _linear(mlp.gate), experts, mlp.renormalize, type(mlp).top_logits, mlp.grouped, score_bias
    )


def _latent_layer(ly: Any) -> decoder_stack.LayerSpec:
    """A DeepSeek layer: latent attention (its query path, kv_a_proj_with_mqa and norm, kv_b_proj's weight as
    the attention absorbs it), then a dense MLP, or routed experts plus the shared ones' dense MLP."""
    attn = ly.self_attn
    low_rank = hasattr(attn, "q_a_proj")
    q = attn.q_b_proj if low_rank else attn.q_proj
    latent = decoder_stack.LatentSpec(
        _linear(attn.kv_a_proj_with_mqa), attn.kv_a_layernorm.weight, attn.w_kv_b,
        _linear(attn.q_a_proj) if low_rank else None, attn.q_a_layernorm.weight if low_rank else None,
    )  # fmt: skip
    norms = (ly.input_layernorm.weight, ly.post_attention_layernorm.weight)
    qkv, o = _linear(q), _linear(attn.o_proj)
    mlp, moe = ly.mlp, None
    if isinstance(ly.mlp, FusedMoE):
        moe, mlp = _moe(ly.mlp), ly.mlp.shared_experts
    gate_up = down = None
    if mlp is not None:
        gate_up, down = _linear(mlp.gate_up_proj), _linear(mlp.down_proj)
    return decoder_stack.LayerSpec(*norms, qkv, o, gate_up, down, moe, latent=latent)


def _latent_stack(model: Any) -> decoder_stack.DecoderStack:
    """A stack of DeepSeek layers: every layer's attention latent, rotated by the first layer's rotary (YaRN's
    tables, the rotary dims interleaved where the family's are)."""
    layers = model.model.layers
    attn = layers[0].self_attn
    rotary, dims = attn.rotary, attn.dims
    specs = [_latent_layer(ly) for ly in layers]
    widths = [ly.gate_up.out_features // 2 for ly in specs if ly.gate_up is not None]
    return decoder_stack.DecoderStack(
        decoder_stack.StackSpec(
            hidden=model.config.hidden_size, heads=attn.num_heads, kv_heads=1, head_dim=dims.qk_rope_head_dim,
            intermediate=max(widths, default=0), eps=model.model.norm.eps, scale=attn.params.scale, cos=rotary.cos,
            sin=rotary.sin, final_norm=model.model.norm.weight, layers=specs, kv_dtype=model.kv_dtype,
            latent=decoder_stack.LatentDims(
                dims.kv_lora_rank, dims.qk_nope_head_dim, dims.v_head_dim, attn.kv_a_layernorm.eps,
                bool(rotary.interleave),
            ),
        )
    )  # fmt: skip


def _layer(ly: Any, facts: Any, rotary: Any) -> decoder_stack.LayerSpec:
    attn = ly.self_attn
    q_norm, k_norm = (attn.q_norm.weight, attn.k_norm.weight) if facts.qk_norm != "none" else (None, None)
    qkv, o = _linear(attn.qkv_proj), _linear(attn.o_proj)
    norms = (ly.input_layernorm.weight, ly.post_attention_layernorm.weight)
    # What the layer's attend() hands the attention op (its ``params``): its window, its soft cap (Gemma 2's) and
    # its sinks (gpt-oss's) where the family has them; its rotary tables where they are not the stack's.
    params = attn.params
    attention: dict[str, Any] = {
        "window": params.window,
        "softcap": params.softcap if facts.attention_softcap else None,
        "sinks": params.sinks.detach() if facts.attention_sinks else None,
    }
    if attn.rotary is not rotary:
        attention.update(cos=attn.rotary.cos, sin=attn.rotary.sin)
    # Gemma's sandwich norms: attention's and the MLP's outputs normed, the MLP's input by its own norm.
    if facts.norms == "sandwich":
        norms = (ly.input_layernorm.weight, ly.pre_feedforward_layernorm.weight)
        attention.update(
            attn_out_norm=ly.post_attention_layernorm.weight, mlp_out_norm=ly.post_feedforward_layernorm.weight
        )
    if isinstance(ly.mlp, FusedMoE):
        return decoder_stack.LayerSpec(*norms, qkv, o, None, None, _moe(ly.mlp), q_norm, k_norm, **attention)
    gate_up, down = _linear(ly.mlp.gate_up_proj), _linear(ly.mlp.down_proj)
    return decoder_stack.LayerSpec(*norms, qkv, o, gate_up, down, None, q_norm, k_norm, **attention)


def build_decoder_stack(model: Any) -> decoder_stack.DecoderStack:
    """The stack for ``model``, which its load plan runs this way (worker/plan/executor.py has checked that the
    family's facts and layers ask nothing the stack does not do, and that every projection has a native
    kernel), built from what its family's spec states of its layers (``model.facts``: q/k norms, activation,
    soft caps, sinks, latent attention) and its layers' own numbers. A family builds every layer from one
    config: one attention scale, residual multiplier and epsilon."""
    facts = model.facts  # worker/models/spec.py's Facts (named, not imported: the engine imports no model module)
    if facts.latent_attention:  # DeepSeek's multi-head latent attention
        return _latent_stack(model)
    layers = model.model.layers
    attn, rotary = layers[0].self_attn, layers[0].self_attn.rotary
    return decoder_stack.DecoderStack(
        decoder_stack.StackSpec(
            hidden=model.config.hidden_size, heads=attn.num_heads, kv_heads=attn.num_kv_heads,
            head_dim=attn.head_dim, intermediate=model.config.intermediate_size, eps=model.model.norm.eps,
            scale=attn.params.scale, cos=rotary.cos, sin=rotary.sin, final_norm=model.model.norm.weight,
            layers=[_layer(ly, facts, rotary) for ly in layers], kv_dtype=model.kv_dtype, qk_norm=facts.qk_norm,
            activation=facts.activation, rotary_dim=rotary.cos.shape[1] * 2, residual_multiplier=float(layers[0].residual_multiplier),
        )
    )  # fmt: skip


class NativeStackExecutor:
    """Embedding lookup in torch, then every layer and the final norm in one native call."""

    kind = "native-stack"

    def __init__(self, model: Any) -> None:
        self.model = model
        self.stack = build_decoder_stack(model)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.stack(self.model.model.embed(input_ids), positions, meta, self._lora_rows())

    def _lora_rows(self) -> decoder_stack.LoRARows | None:
        """The step's tokens by adapter slot, as the model's LoRA batch holds them (None: base only)."""
        slots = getattr(self.model, "lora", None)
        if slots is None or not slots.batch.groups:
            return None
        rows = slots.batch.rows()
        return decoder_stack.LoRARows(rows.slots, rows.offsets, rows.rows)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)  # type: ignore[no-any-return]
