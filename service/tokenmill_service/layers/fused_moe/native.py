"""The experts of a ``FusedMoE`` as one native call (kernels/cpu/moe_mlp.py), where every held
expert's products have a native kernel and its activation a native form (SiLU-and-mul, gpt-oss's
clamped SwiGLU): the same kernels the expert modules call (their biases added as the linear layers
add them), on the same rows, combined in the same order, so the same bits as the layer's Python loop
without its per-expert Python overhead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch

from tokenmill_service.kernels.cpu import moe_mlp
from tokenmill_service.kernels.cpu.ops import NativeCpuOps

if TYPE_CHECKING:
    from tokenmill_service.layers.fused_moe.layer import ExpertMLP, FusedMoE
    from tokenmill_service.layers.linear import LinearBase


def why_not_native(layer: FusedMoE) -> str | None:
    """None when ``native_experts(layer)`` can serve the layer; otherwise why its experts run one by one."""
    from tokenmill_service.layers.fused_moe.layer import ExpertMLP

    expert_type = type(layer).expert_type
    if (
        expert_type.activation is not ExpertMLP.activation
        and expert_type.native_activation is ExpertMLP.native_activation
    ):
        return f"{expert_type.__name__} has an activation the native call does not compute"
    if (reason := moe_mlp.unavailable_reason()) is not None:
        return reason
    for expert in _held(layer):
        if not isinstance(expert.ops, NativeCpuOps):
            return "the layer's ops are not the native CPU kernels"
        for lin in (expert.gate_up_proj, expert.down_proj):
            if lin.quant.native_kernel is None or getattr(lin, "lora", None) is not None:
                return f"an expert's {lin.quant.name} weights have no native kernel"
            if lin.bias is not None and lin.bias.dtype != torch.float32:
                return f"an expert's biases are {str(lin.bias.dtype).removeprefix('torch.')}, not float32"
    return None


def _held(layer: FusedMoE) -> list[ExpertMLP]:
    return [cast("ExpertMLP", expert) for expert in layer.experts.values()]


def _operands(lin: LinearBase) -> tuple[tuple[str, str], torch.Tensor, int]:
    kernel = lin.quant.native_kernel
    assert kernel is not None
    weights, fmt = lin.quant.native_operands(lin)
    return kernel, weights, fmt


def _bias(lin: LinearBase) -> torch.Tensor | None:
    return None if lin.bias is None else lin.bias.detach().contiguous()


def native_experts(layer: FusedMoE) -> moe_mlp.NativeExperts:
    """The layer's held experts as one native call (``why_not_native(layer)`` must be None). A down
    projection's bias is added where its layer adds it: on the expert's first tensor-parallel rank
    only (``ExpertDownLinear``), so once in the all-reduced sum."""
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
