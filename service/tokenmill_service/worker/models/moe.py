"""What the mixture-of-experts families (mixtral.py, qwen3_moe.py, olmoe.py; deepseek_v3.py with its own
routing, shared experts and layers) share on the decoder's seams (decoder.py).

- The decoder layer's MLP (``DecoderLayer.make_mlp``) is a ``FusedMoE`` in the layers that have
  experts, a dense MLP in the others (Qwen3-MoE's ``mlp_only_layers``).
- The load plan sees every expert's projections as linear layers of their own
  (``model.layers.N.mlp.experts.E.gate_up_proj``, ``...down_proj``) and the router as ``mlp.gate``,
  so it chooses a method for each as for any linear layer.
- GGUF: llama.cpp stacks a layer's experts in 3-D tensors (``ffn_gate_exps`` [experts, width,
  hidden], ``ffn_up_exps``, ``ffn_down_exps`` [experts, hidden, width]) and names the router
  ``ffn_gate_inp``; the loader reads a stack as one matrix of all its experts' rows, still
  memory-mapped, and ``unfuse`` cuts it into each expert's rows by expert id.
- Under expert parallelism a rank is not handed the experts it does not hold.
- The native decoder stack runs these layers as it runs Llama's (worker/engine/native_stack.py): a MoE layer's
  router product, softmax top-k and experts in its one call.

The family's own numbers live in ``ModelConfig.extra``: ``num_experts``, ``experts_per_token``,
``expert_width``, ``norm_topk_prob`` (renormalize the chosen weights) and ``moe_layers``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, ClassVar

from torch import nn

from tokenmill_service.worker.layers.fused_moe import FusedMoE
from tokenmill_service.worker.layers.linear import LinearBase
from tokenmill_service.worker.layers.quant.gguf_blocks import CheckpointTensor
from tokenmill_service.worker.models.config import ModelConfig
from tokenmill_service.worker.models.decoder import DecoderForCausalLM, DecoderLayer, GatedMLP
from tokenmill_service.worker.models.params import LayerParams
from tokenmill_service.worker.models.spec import GGUF_LAYER_NAMES, Facts, Tensors

# llama.cpp's names of a MoE layer's router and stacked experts.
GGUF_MOE_NAMES = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
_STACKED = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_proj|up_proj|down_proj)\.weight")
_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.")


def moe_settings(config: ModelConfig) -> tuple[int, int, int, bool, list[int]]:
    """(experts, experts per token, expert width, renormalize, layers with experts) from ``config.extra``."""
    extra = config.extra
    return (
        int(extra["num_experts"]),  # type: ignore[call-overload]
        int(extra["experts_per_token"]),  # type: ignore[call-overload]
        int(extra["expert_width"]),  # type: ignore[call-overload]
        bool(extra["norm_topk_prob"]),
        list(extra["moe_layers"]),  # type: ignore[call-overload]
    )


def set_moe(
    config: ModelConfig, experts: int, per_token: int, width: int, renormalize: bool, layers: Iterable[int]
) -> None:
    if experts < 1 or not 0 < per_token <= experts:
        raise ValueError(f"{per_token} experts per token of {experts} is not a mixture of experts this serves")
    config.extra |= {
        "num_experts": experts,
        "experts_per_token": per_token,
        "expert_width": width,
        "norm_topk_prob": renormalize,
        "moe_layers": sorted(layers),
    }


# Why ``--compile auto`` leaves a mixture of experts eager (read by the plan): each step's grouping of tokens
# by expert is data-dependent, which a compiled graph would guard on and rebuild for.
COMPILE_GAP = "a mixture of experts groups each step's tokens by expert, which graphs cannot hold"
# What the mixture-of-experts families' specs state of their layers.
MOE_FACTS = Facts(experts=True, compile_gap=COMPILE_GAP)
MOE_LAYER_NAMES = {**GGUF_LAYER_NAMES, **GGUF_MOE_NAMES}


def moe_linear_prefixes(config: ModelConfig) -> list[str]:
    experts, _, _, _, moe_layers = moe_settings(config)
    prefixes = []
    for i in range(config.num_layers):
        layer = f"model.layers.{i}"
        prefixes += [f"{layer}.self_attn.qkv_proj", f"{layer}.self_attn.o_proj"]
        if i in moe_layers:
            prefixes.append(f"{layer}.mlp.gate")
            for e in range(experts):
                prefixes += [f"{layer}.mlp.experts.{e}.gate_up_proj", f"{layer}.mlp.experts.{e}.down_proj"]
        else:
            prefixes += [f"{layer}.mlp.gate_up_proj", f"{layer}.mlp.down_proj"]
    return [*prefixes, "lm_head"]


def unfuse_stacked(name: str, config: ModelConfig) -> list[tuple[str, int, int]] | None:
    """A GGUF's stacked experts (read as [experts * rows, cols]) -> each expert's rows, by id."""
    match = _STACKED.fullmatch(name)
    if match is None:
        return None
    layer, projection = match.groups()
    experts, _, width, _, _ = moe_settings(config)
    rows = config.hidden_size if projection == "down_proj" else width
    return [(f"model.layers.{layer}.mlp.experts.{e}.{projection}.weight", e * rows, rows) for e in range(experts)]


def moe_tensors(gguf_layer: dict[str, str] | None = None) -> Tensors:
    """A mixture-of-experts family's tensors: every expert's projections a linear layer, GGUF stacks cut."""
    return Tensors(gguf_layer=gguf_layer or MOE_LAYER_NAMES, linear_prefixes=moe_linear_prefixes, unfuse=unfuse_stacked)


class MoEDecoderLayer(DecoderLayer):
    def make_mlp(self, p: LayerParams) -> nn.Module:
        experts, per_token, width, renormalize, moe_layers = moe_settings(p.config)
        if p.layer_idx not in moe_layers:
            return GatedMLP(p.config, p.prefix, p.ops, p.quant, p.tp)
        return FusedMoE(p.config.hidden_size, width, experts, per_token, renormalize, p.prefix, p.ops, p.quant, p.tp)


class MoEForCausalLM(DecoderForCausalLM):
    """The module of the mixture-of-experts families (registered by each family's spec)."""

    layer_type: ClassVar[type[DecoderLayer]] = MoEDecoderLayer

    def weight_bytes(self) -> int:
        """Bytes of weights one token's forward pass reads: every layer's, but of each layer's experts
        the share one token runs (``experts_per_token / experts``), which is what a decode step's
        bandwidth counts; the memory the weights hold is larger (every expert)."""
        total = super().weight_bytes()
        for layer in self.model.layers:
            moe = layer.mlp
            if isinstance(moe, FusedMoE):
                held = sum(m.quant.weight_bytes(m) for m in moe.experts.modules() if isinstance(m, LinearBase))
                total -= held - held * moe.top_k // moe.num_experts
        return total

    def load_weights(self, tensors: Iterable[tuple[str, CheckpointTensor]]) -> None:
        super().load_weights((name, t) for name, t in tensors if self._holds(name))

    def _holds(self, name: str) -> bool:
        """Whether this rank holds the tensor's layer: every tensor but other ranks' experts."""
        match = _EXPERT.match(name)
        if match is None:
            return True
        mlp: Any = self.model.layers[int(match.group(1))].mlp
        return not isinstance(mlp, FusedMoE) or int(match.group(2)) in mlp.placement.ids
