"""The experts of a ``FusedMoE`` as the operands of one native call (worker/kernels/cpu/moe_mlp.py), for a
layer the load plan runs that way (``LoadPlan.experts``): every held expert's products with a native
kernel and its activation a native form (SiLU-and-mul, gpt-oss's clamped SwiGLU). The same kernels the
expert modules call (their biases added as the linear layers add them), on the same rows, combined in
the same order, so the same bits as the layer's Python loop without its per-expert Python overhead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch

from tokenmill_service.worker.kernels import moe_mlp

if TYPE_CHECKING:
    from tokenmill_service.worker.layers.fused_moe.layer import ExpertMLP, FusedMoE
    from tokenmill_service.worker.layers.linear import LinearBase


def activation_gap(layer_type: type[FusedMoE]) -> str | None:
    """Why the native call cannot compute the experts' activation of ``layer_type`` (None: it can): a
    fact of the family's classes (a family whose experts lack it declares ``native_experts_gap``, which the
    load plan reads)."""
    from tokenmill_service.worker.layers.fused_moe.layer import ExpertMLP

    expert_type = layer_type.expert_type
    if (
        expert_type.activation is not ExpertMLP.activation
        and expert_type.native_activation is ExpertMLP.native_activation
    ):
        return f"{expert_type.__name__} has an activation the native call does not compute"
    return None


def _held(layer: FusedMoE) -> list[ExpertMLP]:
    return [cast("ExpertMLP", expert) for expert in layer.experts.values()]


def _operands(lin: LinearBase) -> tuple[tuple[str, str], torch.Tensor, int]:
    kernel = lin.quant.native_kernel
    if kernel is None or getattr(lin, "lora", None) is not None:
        raise ValueError(f"an expert's {lin.quant.name} weights have no native kernel")
    weights, fmt = lin.quant.native_operands(lin)
    return kernel, weights, fmt


def _bias(lin: LinearBase) -> torch.Tensor | None:
    return None if lin.bias is None else lin.bias.detach().contiguous()


def native_experts(layer: FusedMoE) -> moe_mlp.NativeExperts:
    """The layer's held experts as one native call (ValueError where they do not fit one). A down
    projection's bias is added where its layer adds it: on the expert's first tensor-parallel rank
    only (``ExpertDownLinear``), so once in the all-reduced sum."""
    if (why := activation_gap(type(layer))) is not None:
        raise ValueError(why)
    held = _held(layer)
    experts = [
        moe_mlp.ExpertWeights(
            _operands(ex.gate_up_proj),
            _operands(ex.down_proj),
            _bias(ex.gate_up_proj),
            None if ex.down_proj.tp.rank else _bias(ex.down_proj),
        )
        for ex in held
    ]
    first = layer.placement.first
    width, hidden = held[0].down_proj.in_features, held[0].down_proj.out_features
    swiglu = held[0].native_activation()
    return moe_mlp.NativeExperts(hidden, width, layer.top_k, layer.num_experts, first, experts, swiglu)
