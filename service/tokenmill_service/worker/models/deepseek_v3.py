"""DeepSeek-V3 (``DeepseekV3ForCausalLM``; Kimi K2 and DeepSeek-R1 checkpoints declare it too): a decoder
whose attention is multi-head latent attention (MLA), as transformers' modeling_deepseek_v3.py computes it.

- Queries: ``q_proj``, or the low-rank path ``q_b_proj(q_a_layernorm(q_a_proj(x)))`` (``q_lora_rank``);
  each head is ``qk_nope_head_dim`` plain dims and ``qk_rope_head_dim`` rotated ones.
- Keys and values: ``kv_a_proj_with_mqa`` gives one latent (``kv_lora_rank``, normed by
  ``kv_a_layernorm``) and one rotary key (``qk_rope_head_dim``) per token, shared by every head; these
  two are all a token caches (the backend's ``LatentCacheLayout``), a fraction of a per-head cache
  (``kv_cache_values_per_token``). ``kv_b_proj`` expands a latent into each head's key (nope part)
  and value: here it is never applied to the cache; its two halves are folded in instead
  (``w_uk`` into the query, ``w_uv`` after attention: the absorbed form, worker/kernels/latent_attention.py),
  for prefill chunks and decode tokens alike, which is what keeps prefill = decode bitwise. Its
  weight is kept once, float32 (``w_kv_b``); ``w_uk`` and ``w_uv`` are views of it.
- Rotary: YaRN (``rope_type`` yarn) with DeepSeek's attention-scale correction (``mscale_all_dim``
  squared on the softmax scale, ``mscale / mscale_all_dim`` on cos and sin), over DeepSeek's
  interleaved pairs (``rope_interleave``: the rotary dims are de-interleaved, then rotated as halves,
  which is transformers' ``apply_rotary_pos_emb_interleave`` exactly).

The first ``first_k_dense_replace`` layers have a dense MLP; the others a mixture of experts
(``DeepseekV3MoE``: the fused MoE layer with DeepSeek-V3's routing, plus shared experts), as
transformers' ``DeepseekV3MoE`` computes it:

- routing (worker/kernels/moe_routing.py, ``GroupedTopK``): sigmoid scores of the router (``mlp.gate``)
  in float32, the score-correction bias (``mlp.gate.e_score_correction_bias``) added for choosing only,
  the ``n_routed_experts`` split into ``n_group`` groups scored by the sum of their two best corrected
  scores, the ``topk_group`` best groups kept, the ``num_experts_per_tok`` best experts among theirs;
  weights from the uncorrected scores, renormalized when ``norm_topk_prob``, times
  ``routed_scaling_factor``;
- each routed expert ``moe_intermediate_size`` wide; ``n_shared_experts`` shared experts as one dense
  MLP ``moe_intermediate_size * n_shared_experts`` wide, run on every token and added to the routed sum.

Softmax routing (DeepSeek-V2's, a GGUF whose ``expert_gating_func`` says softmax or nothing) is
refused by ``unserved_reason``, as are groups that cannot hold a token's experts.

Under tensor parallelism each rank holds its share of the heads (``q_b_proj`` / ``q_proj``,
``kv_b_proj``, ``o_proj``) and all of the latent path (``q_a_proj``, ``kv_a_proj_with_mqa``, their
norms), whose cache every rank keeps whole. GGUF files are llama.cpp's ``deepseek2`` (its tensor names,
``kv_b`` whole or split into ``k_b`` / ``v_b``; experts stacked as ``ffn_{gate,up,down}_exps``, the shared
ones ``ffn_{gate,up,down}_shexp``, the correction bias ``exp_probs_b``; routing from its ``expert_*``
keys). Under ``--expert-parallel`` each rank holds its share of the routed experts whole and the shared
experts split as a dense MLP.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, ClassVar

import structlog
import torch
from torch import nn

from tokenmill_service.worker.distributed.parallel import TensorParallel
from tokenmill_service.worker.kernels.attention_metadata import AttentionMetadata
from tokenmill_service.worker.kernels.attention_params import LatentAttentionParams, LatentCache
from tokenmill_service.worker.kernels.interface import Ops
from tokenmill_service.worker.layers.fused_moe import FusedMoE, GroupedTopK
from tokenmill_service.worker.layers.linear import (
    ColumnParallelLinear,
    QuantFactory,
    ReplicatedLinear,
    RowParallelLinear,
)
from tokenmill_service.worker.layers.norm import RMSNorm
from tokenmill_service.worker.layers.quant.gguf_blocks import CheckpointTensor, dense
from tokenmill_service.worker.layers.rotary import RotaryEmbedding
from tokenmill_service.worker.models.config import ModelConfig
from tokenmill_service.worker.models.decoder import DecoderLayer, DecoderModel, GatedMLP
from tokenmill_service.worker.models.deepseek_config import (
    GGUF_LAYER_NAMES,
    kv_cache_values_per_token,
    latent_stack_gap,
    linear_prefixes,
    mla_dims,
    mtp_linear_prefixes,
    read_gguf,
    read_hf,
    unserved_reason,
)
from tokenmill_service.worker.models.deepseek_mtp import DeepseekMTPLayer, mtp_layer_count, mtp_name, mtp_prefix
from tokenmill_service.worker.models.moe import MOE_FACTS, MoEForCausalLM, moe_settings, unfuse_stacked
from tokenmill_service.worker.models.params import LayerParams
from tokenmill_service.worker.models.registry import register_family
from tokenmill_service.worker.models.spec import ConfigReader, FamilySpec, Names, Tensors
from tokenmill_service.worker.models.yarn import YARN_TYPES, Yarn

log = structlog.get_logger(__name__)

_LAYER_INDEX = re.compile(r"model\.layers\.(\d+)\.")
# The router's score-correction bias: transformers' name, and llama.cpp's ("exp_probs_b.bias") mapped.
# An expert's tensor in a multi-token-prediction layer's block, as ``_mtp_names`` renames it.
_MTP_EXPERT = re.compile(r"mtp\.(\d+)\.block\.mlp\.experts\.(\d+)\.")
_SCORE_BIAS = re.compile(r"model\.layers\.(\d+)\.mlp\.gate\.e_score_correction(?:_bias|\.bias)")
# transformers' DeepseekV3RMSNorm default: the latent norms do not take the config's rms_norm_eps.
LATENT_NORM_EPS = 1e-6


class DeepseekRotaryEmbedding(RotaryEmbedding):
    """The rotary dims of q and k, YaRN-scaled where configured; interleaved pairs are de-interleaved
    first (even dims, then odd ones), after which the halves rotation is transformers' interleaved one."""

    deinterleave: torch.Tensor

    def __init__(
        self, dim: int, max_positions: int, theta: float, yarn: Yarn | None, interleave: bool, ops: Ops
    ) -> None:
        super().__init__(dim, max_positions, theta, None, ops)
        if yarn is not None:
            freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), yarn.inv_freq(dim, theta))
            self.cos, self.sin = freqs.cos() * yarn.cos_sin_factor, freqs.sin() * yarn.cos_sin_factor
        self.register_buffer(
            "deinterleave", torch.cat((torch.arange(0, dim, 2), torch.arange(1, dim, 2))), persistent=False
        )
        self.interleave = interleave

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.interleave:
            q, k = q.index_select(-1, self.deinterleave), k.index_select(-1, self.deinterleave)
        return self.ops.rotary(q, k, positions, self.cos, self.sin)


class DeepseekV3Attention(nn.Module):
    """Multi-head latent attention for one tensor-parallel rank (its share of the heads)."""

    w_kv_b: torch.Tensor

    def __init__(self, p: LayerParams) -> None:
        super().__init__()
        config, ops, quant, prefix, tp = p.config, p.ops, p.quant, p.prefix, p.tp
        self.layer_idx = p.layer_idx
        self.rotary = p.rotary
        self.ops = ops
        self.dims = d = mla_dims(config)
        hidden, heads, bias = config.hidden_size, config.num_heads, config.attention_bias
        self.num_heads = tp.split(heads, "attention heads")
        if d.q_lora_rank:
            self.q_a_proj = ReplicatedLinear(hidden, d.q_lora_rank, bias, quant(f"{prefix}.q_a_proj"))
            act = self.q_a_proj.quant.act_dtype
            self.q_a_layernorm = RMSNorm(d.q_lora_rank, LATENT_NORM_EPS, ops, act)
            self.q_b_proj = ColumnParallelLinear(
                d.q_lora_rank, heads * d.qk_head_dim, False, quant(f"{prefix}.q_b_proj"), tp
            )
        else:
            self.q_proj = ColumnParallelLinear(hidden, heads * d.qk_head_dim, False, quant(f"{prefix}.q_proj"), tp)
        self.kv_a_proj_with_mqa = ReplicatedLinear(
            hidden, d.kv_lora_rank + d.qk_rope_head_dim, bias, quant(f"{prefix}.kv_a_proj_with_mqa")
        )
        act = self.kv_a_proj_with_mqa.quant.act_dtype
        self.kv_a_layernorm = RMSNorm(d.kv_lora_rank, LATENT_NORM_EPS, ops, act)
        self.kv_b_proj = ColumnParallelLinear(
            d.kv_lora_rank, heads * (d.qk_nope_head_dim + d.v_head_dim), False, quant(f"{prefix}.kv_b_proj"), tp
        )
        self.o_proj = RowParallelLinear(heads * d.v_head_dim, hidden, bias, quant(f"{prefix}.o_proj"), tp)
        yarn: Yarn | None = config.extra.get("yarn")  # type: ignore[assignment]
        scale = d.qk_head_dim**-0.5 * (yarn.softmax_factor if yarn is not None else 1.0)
        # kv_b_proj's weight, float32, once the weights are loaded (``absorb``): [H, nope + V, L]; the
        # up-projections of ``params`` are views of it from then on.
        self.register_buffer("w_kv_b", torch.empty(0), persistent=False)
        self.params = LatentAttentionParams(w_uk=torch.empty(0), w_uv=torch.empty(0), scale=scale)

    def absorb(self) -> None:
        """Keep ``kv_b_proj``'s weight [H * (nope + V), L] as its method dequantizes it, float32, as
        ``w_kv_b`` [H, nope + V, L], and drop the layer (it is never applied: its two halves are
        ``params.w_uk`` [H, nope, L] and ``params.w_uv`` [H, L, V], views of ``w_kv_b``). A float32 dense
        weight stored row-major is kept as it is, not copied."""
        d = self.dims
        w = self.kv_b_proj.quant.dequantized(self.kv_b_proj).detach().float().contiguous()
        self.w_kv_b = w.view(self.num_heads, d.qk_nope_head_dim + d.v_head_dim, d.kv_lora_rank)
        del self.kv_b_proj
        nope = d.qk_nope_head_dim
        self.params = dataclasses.replace(
            self.params, w_uk=self.w_kv_b[:, :nope], w_uv=self.w_kv_b[:, nope:].transpose(1, 2)
        )

    def project(self, positions: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The queries [T, H, nope + rope] (rope part rotated), the normed latents [T, L] and the
        rotated keys [T, rope]: what ``attend`` takes (as a Llama's q, k and v)."""
        d, t = self.dims, x.shape[0]
        if d.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))[0])
        else:
            q = self.q_proj(x)
        q_nope, q_rope = q.view(t, self.num_heads, d.qk_head_dim).split([d.qk_nope_head_dim, d.qk_rope_head_dim], -1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([d.kv_lora_rank, d.qk_rope_head_dim], -1)
        latent = self.kv_a_layernorm(latent)[0]
        q_rope, k_rope = self.rotary(positions, q_rope, k_rope.reshape(t, 1, d.qk_rope_head_dim))
        return torch.cat((q_nope, q_rope), dim=-1), latent, k_rope.reshape(t, d.qk_rope_head_dim)

    def attend(
        self, q: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Store the new latents and rotary keys in the latent cache, attend over it: [T, heads * v_head_dim]."""
        cache = LatentCache(meta.k_cache[self.layer_idx], meta.v_cache[self.layer_idx])
        self.ops.store_latent(latent, k_rope, cache, meta.slot_mapping)
        q_nope, q_rope = torch.split(q, [self.dims.qk_nope_head_dim, self.dims.qk_rope_head_dim], -1)
        return self.ops.latent_attention(q_nope, q_rope, cache, meta, self.params).flatten(1)


class DeepseekV3MoE(FusedMoE):
    """The routed experts (the fused MoE layer, grouped sigmoid routing) and the shared experts: a dense
    MLP on every token, added to the routed sum (each all-reduced on its own under parallelism)."""

    def __init__(self, config: ModelConfig, prefix: str, ops: Ops, quant: QuantFactory, tp: TensorParallel) -> None:
        experts, per_token, width, renormalize, _ = moe_settings(config)
        routing: GroupedTopK = config.extra["moe_routing"]  # type: ignore[assignment]
        super().__init__(config.hidden_size, width, experts, per_token, renormalize, prefix, ops, quant, tp, routing)
        shared = int(config.extra["shared_expert_width"])  # type: ignore[call-overload]
        self.shared_experts: GatedMLP | None = None
        if shared:
            shape = dataclasses.replace(config, intermediate_size=shared)
            self.shared_experts = GatedMLP(shape, f"{prefix}.shared_experts", ops, quant, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routed = super().forward(x)
        return routed if self.shared_experts is None else routed + self.shared_experts(x)


class DeepseekV3DecoderLayer(DecoderLayer):
    """The decoder's layer whose attention is MLA and whose feed-forward block is chosen per layer (``make_mlp``)."""

    def make_mlp(self, p: LayerParams) -> nn.Module:
        """The feed-forward block of layer ``layer_idx``: dense (gate/up/down) before ``first_k_dense_replace``,
        routed and shared experts from it on."""
        config = p.config
        first_moe = config.extra_int("first_k_dense_replace")
        if p.layer_idx >= first_moe and "num_experts" in config.extra:
            return DeepseekV3MoE(config, p.prefix, p.ops, p.quant, p.tp)
        return GatedMLP(config, p.prefix, p.ops, p.quant, p.tp)


class DeepseekV3Model(DecoderModel):
    def make_rotary(self, config: ModelConfig, ops: Ops) -> RotaryEmbedding:
        d = mla_dims(config)
        yarn: Yarn | None = config.extra.get("yarn")  # type: ignore[assignment]
        return DeepseekRotaryEmbedding(
            d.qk_rope_head_dim, config.max_position_embeddings, config.rope_theta, yarn, d.rope_interleave, ops
        )


class DeepseekV3ForCausalLM(MoEForCausalLM):
    attention_type = DeepseekV3Attention  # type: ignore[assignment]  # not a Llama's: latent, with its own project/attend
    model_type: ClassVar[type[DecoderModel]] = DeepseekV3Model
    layer_type: ClassVar[type[DecoderLayer]] = DeepseekV3DecoderLayer
    # The attention's projections keep their own names; only the dense MLP packs gate/up.
    packed_modules: ClassVar[Mapping[str, tuple[str, str | int]]] = {
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def attach_mtp(self, quant: QuantFactory) -> None:
        """Build the checkpoint's first multi-token-prediction layer (before ``load_weights``), the draft
        model of ``--speculative-method mtp`` (chained for more drafts, as vLLM runs one): its weights are
        loaded then, its block's latents cached as one layer after the decoder's; further ones are left aside."""
        config = self.config
        rotary: RotaryEmbedding = self.model.layers[0].self_attn.rotary  # type: ignore[union-attr,assignment]
        self.mtp = nn.ModuleList(
            DeepseekMTPLayer(
                LayerParams(
                    config, mtp_prefix(i), config.num_layers + i, rotary, self.ops, quant, self.tp, self.act_dtype
                ),
                lambda p: DeepseekV3DecoderLayer(p, DeepseekV3Attention),  # type: ignore[arg-type]
            )
            for i in range(min(1, mtp_layer_count(config)))
        )

    def attention_windows(self) -> list[int | None]:
        """No sliding window: every layer attends to the whole context."""
        return [None] * len(self.model.layers)

    def weight_bytes(self) -> int:
        """As the other families', ``kv_b_proj`` counted as the attention keeps it (float32, ``w_kv_b``)."""
        kept = [m.w_kv_b for m in self.modules() if isinstance(m, DeepseekV3Attention)]
        return super().weight_bytes() + sum(w.numel() * w.element_size() for w in kept)

    def kv_cache_shapes(self, num_blocks: int, block_size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The (latent, rotary key) cache shapes, in its ops backend's latent layout."""
        layout = self.ops.latent_cache_layout
        if layout is None:
            raise ValueError(f"the {self.ops.name} ops have no latent attention")
        d = mla_dims(self.config)
        layers = len(self.model.layers) + len(self.mtp)  # the MTP blocks' latents after the decoder's
        return layout.shapes(layers, num_blocks, block_size, d.kv_lora_rank, d.qk_rope_head_dim)

    def load_weights(self, tensors: Iterable[tuple[str, CheckpointTensor]]) -> None:
        biased: set[int] = set()
        super().load_weights(self._score_biases(self._join_kv_b(self._mtp_names(tensors)), biased))
        blocks = [*self.model.layers, *(mtp.block for mtp in self.mtp)]
        moe_layers = {i for i, layer in enumerate(blocks) if isinstance(layer.mlp, FusedMoE)}
        if missing := sorted(moe_layers - biased):
            names = ", ".join(f"model.layers.{i}.mlp.gate.e_score_correction_bias" for i in missing[:4])
            raise ValueError(f"the checkpoint lacks the routers' score-correction bias: {names}")
        for module in self.modules():
            if isinstance(module, DeepseekV3Attention):
                module.absorb()

    def _score_biases(
        self, tensors: Iterable[tuple[str, CheckpointTensor]], loaded: set[int]
    ) -> Iterator[tuple[str, CheckpointTensor]]:
        """The tensors less the routers' score-correction biases, which go to their layers' ``score_bias``
        (float32, whole on every rank); ``loaded`` gets the layers that had one."""
        for name, tensor in tensors:
            match = _SCORE_BIAS.fullmatch(name)
            if match is None:
                yield name, tensor
                continue
            layer = int(match.group(1))
            num_layers = len(self.model.layers)
            block: Any = self.model.layers[layer] if layer < num_layers else self.mtp[layer - num_layers].block
            mlp = block.mlp
            if not isinstance(mlp, FusedMoE) or mlp.score_bias is None:
                raise ValueError(f"checkpoint tensor {name!r} has no counterpart in the model")
            bias = dense(tensor).float().reshape(-1)
            if bias.shape != mlp.score_bias.shape:
                raise ValueError(f"{name} holds {bias.numel()} values for {mlp.num_experts} experts")
            mlp.score_bias.copy_(bias)
            loaded.add(layer)

    def _holds(self, name: str) -> bool:
        """As the decoder's (``MoEForCausalLM._holds``), for an MTP block's experts too: under
        ``--expert-parallel`` a rank holds only its share of them."""
        match = _MTP_EXPERT.match(name)
        if match is None:
            return super()._holds(name)
        layer: Any = self.mtp[int(match.group(1))]
        mlp = layer.block.mlp
        return not isinstance(mlp, FusedMoE) or int(match.group(2)) in mlp.placement.ids

    def _mtp_names(self, tensors: Iterable[tuple[str, CheckpointTensor]]) -> Iterator[tuple[str, CheckpointTensor]]:
        """The tensors, those of the multi-token-prediction layers DeepSeek-V3's files keep after the
        decoder's (``model.layers.<num_hidden_layers + i>...``) renamed into ``mtp.<i>`` where they are
        served (``attach_mtp``), left aside where not (transformers skips them too). Their routers'
        score-correction biases keep their layer numbers (``_score_biases`` finds the MTP block)."""
        skipped = 0
        num_layers = self.config.num_layers
        for name, tensor in tensors:
            target = mtp_name(name, num_layers)
            if target is None or (target and _SCORE_BIAS.fullmatch(name) and len(self.mtp)):
                yield name, tensor
            elif target and int(target.split(".")[1]) < len(self.mtp):
                yield target, tensor
            else:
                skipped += 1
        if skipped and not len(self.mtp):
            log.info("mtp_layers_skipped", tensors=skipped, layers_from=num_layers)

    def _join_kv_b(self, tensors: Iterable[tuple[str, CheckpointTensor]]) -> Iterator[tuple[str, CheckpointTensor]]:
        """The tensors, with a GGUF's split ``k_b_proj`` [H, L, nope] and ``v_b_proj`` [H, V, L] (each read
        as the matrix of its rows) joined back into ``kv_b_proj`` [H * (nope + V), L] as the Hugging Face
        checkpoint holds it (dequantized: the absorbed attention multiplies it in float32 whatever it was)."""
        halves: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in tensors:
            parent, _, leaf = name.rpartition(".")
            attn, _, proj = parent.rpartition(".")
            if proj not in ("k_b_proj", "v_b_proj") or leaf != "weight":
                yield name, tensor
                continue
            halves.setdefault(attn, {})[proj] = dense(tensor).float()
            if len(halves[attn]) == 2:
                pair = halves.pop(attn)
                # The GGUF loader reads a 3-D tensor as one matrix of its rows: the heads put back.
                d, heads = mla_dims(self.config), self.config.num_heads
                k_b = pair["k_b_proj"].reshape(heads, d.kv_lora_rank, d.qk_nope_head_dim).transpose(1, 2)
                v_b = pair["v_b_proj"].reshape(heads, d.v_head_dim, d.kv_lora_rank)
                joined = torch.cat((k_b, v_b), dim=1)
                yield f"{attn}.kv_b_proj.weight", joined.reshape(-1, joined.shape[-1])
        if halves:
            raise ValueError(f"the checkpoint holds one half of kv_b_proj only in {', '.join(sorted(halves))}")


# The native decoder stack runs its layers: latent attention, grouped routing, shared experts, dense first
# layers (worker/engine/native_stack.py); kv_b_proj is absorbed at load (``absorb``), never applied by its kernel.
DEEPSEEK_V3 = register_family(
    FamilySpec(
        ("deepseek_v3",),
        DeepseekV3ForCausalLM,
        Names({"DeepseekV3ForCausalLM": "deepseek_v3"}, {"deepseek2": "deepseek_v3"}),
        ConfigReader(read_hf, read_gguf, hf_rope_types=YARN_TYPES, gguf_reads_attention=True),
        Tensors(
            gguf_layer=GGUF_LAYER_NAMES,
            linear_prefixes=linear_prefixes,
            mtp_linear_prefixes=mtp_linear_prefixes,
            unfuse=unfuse_stacked,
            absorbed=frozenset({"kv_b_proj"}),
        ),
        dataclasses.replace(MOE_FACTS, latent_attention=True),
        unserved_reason=unserved_reason,
        kv_cache_values_per_token=kv_cache_values_per_token,
        latent_stack_gap=latent_stack_gap,
    )
)
