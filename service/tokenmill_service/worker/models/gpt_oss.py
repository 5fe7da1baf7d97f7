"""gpt-oss (transformers' modeling_gpt_oss.py is the reference): a mixture-of-experts decoder on the
Llama seams, with

- attention sinks: a learned logit per head (``self_attn.sinks``) in each query's softmax
  denominator (``Ops.attention``'s ``sinks``), biases on q/k/v and o;
- sliding-window layers (``layer_types``; 128 keys in the released models) alternating with full ones;
- YaRN rotary scaling (``rope_type`` yarn, over the halves layout; deepseek_v3.py's ``Yarn``);
- a router with a bias (``mlp.router``) that picks the top ``num_experts_per_tok`` logits, then
  softmaxes over the chosen ones;
- experts with biases whose activation is the clamped SwiGLU: gate clamped above at ``swiglu_limit``,
  up to [-limit, limit], gate * sigmoid(``swiglu_alpha`` * gate) * (up + 1).

transformers stores the experts stacked and transposed (``mlp.experts.gate_up_proj`` [experts, hidden,
2 * width] with gate and up interleaved by column, ``gate_up_proj_bias`` [experts, 2 * width],
``down_proj`` [experts, width, hidden], ``down_proj_bias``); ``load_weights`` cuts each expert's
rows out of them by expert id, gate and up de-interleaved into the packed gate/up layer. openai's
checkpoints store the expert matrices as MXFP4 (``quantization_config`` quant_method mxfp4:
``<name>_blocks`` / ``<name>_scales``, [experts, out, in] untransposed), which the loader reads as
MXFP4 blocks (worker/layers/quant/mxfp4.py) and the same cut serves.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar, cast

import torch
from gguf import GGMLQuantizationType as QType
from torch import nn

from tokenmill_service.worker.kernels.interface import Ops
from tokenmill_service.worker.layers.fused_moe import FusedMoE
from tokenmill_service.worker.layers.fused_moe.layer import ExpertMLP
from tokenmill_service.worker.layers.linear import RowParallelLinear
from tokenmill_service.worker.layers.quant.gguf_blocks import CheckpointTensor, GGUFBlocks, dense, describe
from tokenmill_service.worker.layers.rotary import RotaryEmbedding
from tokenmill_service.worker.models.config import FULL, SLIDING, ModelConfig
from tokenmill_service.worker.models.decoder import DecoderAttention, DecoderModel
from tokenmill_service.worker.models.hf_loader import rope_params, rope_type
from tokenmill_service.worker.models.moe import (
    MOE_FACTS,
    MOE_LAYER_NAMES,
    MoEDecoderLayer,
    MoEForCausalLM,
    moe_settings,
    moe_tensors,
    set_moe,
    unfuse_stacked,
)
from tokenmill_service.worker.models.params import LayerParams
from tokenmill_service.worker.models.registry import register_family
from tokenmill_service.worker.models.spec import ConfigReader, FamilySpec, GGUFField, Names
from tokenmill_service.worker.models.yarn import YARN_TYPES, Yarn, hf_yarn

_SINKS = re.compile(r"model\.layers\.(\d+)\.self_attn\.sinks(?:\.weight)?")
# llama.cpp's stacked experts' biases ([experts, rows]; their weights are moe.py's).
_STACKED_BIAS = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_proj|up_proj|down_proj)\.bias")
# transformers' stacked experts: (layer, projection, "" or "_bias").
_STACKED = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias)?")
_EXPERT_BIAS = re.compile(r"model\.layers\.\d+\.mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)\.bias")
_ROUTER = re.compile(r"(model\.layers\.\d+\.mlp)\.router\.(weight|bias)")


class GptOssAttention(DecoderAttention):
    """Llama attention with an output bias, a sliding window on the layers that have one and a sink per head."""

    sinks: torch.Tensor

    def __init__(self, p: LayerParams) -> None:
        super().__init__(p)
        config, tp = p.config, p.tp
        hidden, heads = config.hidden_size, config.num_heads * config.head_dim
        self.o_proj = RowParallelLinear(heads, hidden, config.attention_bias, p.quant(f"{p.prefix}.o_proj"), tp)
        self.first_head = tp.rank * self.num_heads
        self.register_buffer("sinks", torch.zeros(self.num_heads, dtype=torch.float32), persistent=False)
        # The buffer itself, which ``load_sinks`` fills in place.
        self.params = dataclasses.replace(self.params, sinks=self.sinks)

    def load_sinks(self, tensor: CheckpointTensor) -> None:
        """The checkpoint's sinks [heads]: this rank's heads'."""
        self.sinks.copy_(dense(tensor).float()[self.first_head : self.first_head + self.num_heads])


class GptOssExpert(ExpertMLP):
    bias: ClassVar[bool] = True
    swiglu: tuple[float, float] = (1.702, 7.0)  # (alpha, limit): the config's, set by the layer

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        alpha, limit = self.swiglu
        return self.ops.clamped_swiglu_and_mul(gate_up, alpha, limit)

    def native_activation(self) -> tuple[float, float] | None:
        return self.swiglu


class GptOssMoE(FusedMoE):
    """The router's top-k logits, softmaxed over the chosen; experts with biases and the clamped SwiGLU."""

    expert_type: ClassVar[type[ExpertMLP]] = GptOssExpert
    router_bias: ClassVar[bool] = True
    top_logits: ClassVar[bool] = True


class GptOssDecoderLayer(MoEDecoderLayer):
    def make_mlp(self, p: LayerParams) -> nn.Module:
        config = p.config
        experts, per_token, width, _, _ = moe_settings(config)
        moe = GptOssMoE(config.hidden_size, width, experts, per_token, True, p.prefix, p.ops, p.quant, p.tp)
        swiglu = (float(cast(float, config.extra["swiglu_alpha"])), float(cast(float, config.extra["swiglu_limit"])))
        for expert in moe.experts.values():
            cast(GptOssExpert, expert).swiglu = swiglu
        return moe


class YarnRotaryEmbedding(RotaryEmbedding):
    """Rotary tables of YaRN-scaled frequencies, cos and sin times its attention factor (halves layout)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, yarn: Yarn | None, ops: Ops) -> None:
        super().__init__(head_dim, max_positions, theta, None, ops)
        if yarn is not None:
            freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), yarn.inv_freq(head_dim, theta))
            self.cos, self.sin = freqs.cos() * yarn.cos_sin_factor, freqs.sin() * yarn.cos_sin_factor


class GptOssModel(DecoderModel):
    def make_rotary(self, config: ModelConfig, ops: Ops) -> RotaryEmbedding:
        yarn = cast(Yarn | None, config.extra.get("yarn"))
        return YarnRotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta, yarn, ops)


class GptOssForCausalLM(MoEForCausalLM):
    attention_type = GptOssAttention
    model_type = GptOssModel
    layer_type = GptOssDecoderLayer

    def load_weights(self, tensors: Iterable[tuple[str, CheckpointTensor]]) -> None:
        missing = {f"model.layers.{i}.self_attn.sinks" for i in range(self.config.num_layers)}

        def routed() -> Iterator[tuple[str, CheckpointTensor]]:
            for name, tensor in tensors:
                if sinks := _SINKS.fullmatch(name):
                    layer = int(sinks.group(1))
                    cast(GptOssAttention, self.model.layers[layer].self_attn).load_sinks(tensor)
                    missing.discard(f"model.layers.{layer}.self_attn.sinks")
                elif _EXPERT_BIAS.fullmatch(name) and isinstance(tensor, torch.Tensor) and tensor.dim() == 2:
                    yield name, tensor.reshape(-1)  # one expert's row of a stacked bias
                elif router := _ROUTER.fullmatch(name):
                    yield f"{router.group(1)}.gate.{router.group(2)}", tensor
                elif stacked := _STACKED.fullmatch(name):
                    yield from self._experts(stacked, tensor)
                else:
                    yield name, tensor

        super().load_weights(routed())
        if missing:
            raise ValueError(f"the checkpoint lacks {len(missing)} tensor(s): {', '.join(sorted(missing)[:8])}")

    def _experts(self, match: re.Match[str], tensor: CheckpointTensor) -> Iterator[tuple[str, CheckpointTensor]]:
        """transformers' stacked experts -> each held expert's rows (nn.Linear's [out, in]), by expert id."""
        layer, projection, bias = match.groups()
        moe = cast(GptOssMoE, self.model.layers[int(layer)].mlp)
        kind = "bias" if bias else "weight"
        for e in moe.placement.ids:
            prefix = f"model.layers.{layer}.mlp.experts.{e}"
            rows: torch.Tensor | GGUFBlocks
            if isinstance(tensor, GGUFBlocks):  # MXFP4 [experts * out, blocks, 17]: rows already [out, in]
                out = tensor.shape[0] // moe.num_experts
                rows = tensor.narrow(0, e * out, out)
            elif isinstance(tensor, torch.Tensor):
                rows = tensor[e] if bias else tensor[e].t()  # [2 * width (interleaved) or hidden, ...]
            else:
                raise ValueError(f"gpt-oss experts come as MXFP4 blocks or float tensors, not {describe(tensor)}")  # noqa: TRY004
            if projection == "down_proj":
                yield f"{prefix}.down_proj.{kind}", _contiguous(rows)
            else:
                yield f"{prefix}.gate_proj.{kind}", _contiguous(_rows(rows, 0))
                yield f"{prefix}.up_proj.{kind}", _contiguous(_rows(rows, 1))


def _read_hf(raw: dict[str, Any], hf_architecture: str, config: ModelConfig) -> None:
    experts, per_token = int(raw["num_local_experts"]), int(raw["num_experts_per_tok"])
    set_moe(config, experts, per_token, config.intermediate_size, True, range(config.num_layers))
    extra = config.extra
    extra["swiglu_alpha"] = float(raw.get("swiglu_alpha", 1.702))
    extra["swiglu_limit"] = float(raw.get("swiglu_limit", 7.0))
    extra["sliding_window"] = int(raw.get("sliding_window") or 128)
    types = raw.get("layer_types") or [SLIDING if i % 2 == 0 else FULL for i in range(config.num_layers)]
    if len(types) != config.num_layers or set(types) - {SLIDING, FULL}:
        raise ValueError(f"layer_types {types} are not {config.num_layers} of {SLIDING!r} / {FULL!r}")
    extra["layer_types"] = list(types)
    params = rope_params(raw)
    if rope_type(params) in YARN_TYPES:
        extra["yarn"] = hf_yarn(params, None, config)


def _read_gguf(field: GGUFField, gguf_architecture: str, config: ModelConfig) -> None:
    """llama.cpp's "gpt-oss" GGUFs: its expert counts, the window (every even layer's, as llama.cpp
    lays them out), YaRN; alpha and limit are not written (llama.cpp fixes them at gpt-oss's)."""
    arch = gguf_architecture
    experts, per_token = int(field(f"{arch}.expert_count")), int(field(f"{arch}.expert_used_count") or 0)
    width = int(field(f"{arch}.expert_feed_forward_length") or config.intermediate_size)
    set_moe(config, experts, per_token, width, True, range(config.num_layers))
    window = field(f"{arch}.attention.sliding_window")
    config.extra |= {
        "swiglu_alpha": 1.702,
        "swiglu_limit": 7.0,
        "sliding_window": int(window or 128),
        "layer_types": [SLIDING if i % 2 == 0 else FULL for i in range(config.num_layers)],
    }
    if field(f"{arch}.rope.scaling.type") == "yarn":
        config.extra["yarn"] = Yarn(
            factor=float(field(f"{arch}.rope.scaling.factor")),
            original_max_positions=int(field(f"{arch}.rope.scaling.original_context_length")),
            beta_fast=float(field(f"{arch}.rope.scaling.yarn_beta_fast") or 32),
            beta_slow=float(field(f"{arch}.rope.scaling.yarn_beta_slow") or 1),
            truncate=False,  # gpt-oss's YaRN (its config.json says so; GGUF has no key for it)
        )


def _unfuse(name: str, config: ModelConfig) -> list[tuple[str, int, int]] | None:
    """moe.py's stacked expert weights, and llama.cpp's stacked expert biases [experts, rows] by expert."""
    match = _STACKED_BIAS.fullmatch(name)
    if match is None:
        return unfuse_stacked(name, config)
    layer, projection = match.groups()
    experts = moe_settings(config)[0]
    return [(f"model.layers.{layer}.mlp.experts.{e}.{projection}.bias", e, 1) for e in range(experts)]


def _hf_stored_types(config: ModelConfig) -> dict[str, QType]:
    """openai's MXFP4 checkpoints: every expert's matrices (as the load plan names their sources)."""
    if not config.extra.get("mxfp4"):
        return {}
    experts = moe_settings(config)[0]
    return {
        f"model.layers.{i}.mlp.experts.{e}.{projection}.weight": QType.MXFP4
        for i in range(config.num_layers)
        for e in range(experts)
        for projection in ("gate_proj", "up_proj", "down_proj")
    }


def _rows(t: torch.Tensor | GGUFBlocks, first: int) -> torch.Tensor | GGUFBlocks:
    """Every other row of t from ``first``: gate (0) or up (1) of an interleaved gate/up."""
    return t.rows(slice(first, None, 2)) if isinstance(t, GGUFBlocks) else t[first::2]


def _contiguous(t: CheckpointTensor) -> CheckpointTensor:
    return t.contiguous() if isinstance(t, torch.Tensor) else t


GPT_OSS = register_family(
    FamilySpec(
        ("gpt_oss",),
        GptOssForCausalLM,
        Names({"GptOssForCausalLM": "gpt_oss"}, {"gpt-oss": "gpt_oss"}),
        ConfigReader(_read_hf, _read_gguf, hf_rope_types=YARN_TYPES, gguf_rope_types=frozenset({"yarn"})),
        dataclasses.replace(
            moe_tensors(
                {**MOE_LAYER_NAMES, "post_attention_norm": "post_attention_layernorm", "attn_sinks": "self_attn.sinks"}
            ),
            unfuse=_unfuse,
            hf_stored_types=_hf_stored_types,
        ),
        dataclasses.replace(MOE_FACTS, sliding_windows=True, attention_sinks=True),
    )
)
