"""The experts of a ``FusedMoE`` as one native call (kernels/cpu/moe_mlp.py), where every held
expert's products have a native kernel: the same kernels the expert modules call, on the same rows,
combined in the same order, so the same bits as the layer's Python loop without its per-expert
Python overhead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tokenmill_service.kernels.cpu import moe_mlp
from tokenmill_service.kernels.cpu.ops import NativeCpuOps

if TYPE_CHECKING:
    from tokenmill_service.layers.fused_moe.layer import FusedMoE
    from tokenmill_service.layers.linear import LinearBase


def why_not_native(layer: FusedMoE) -> str | None:
    """None when ``native_experts(layer)`` can serve the layer; otherwise why its experts run one by one."""
    from tokenmill_service.layers.fused_moe.layer import ExpertMLP

    expert_type = type(layer).expert_type
    if expert_type.bias or expert_type.activation is not ExpertMLP.activation:
        return f"{expert_type.__name__} has biases or its own activation"
    if (reason := moe_mlp.unavailable_reason()) is not None:
        return reason
    for expert in layer.experts.values():
        if not isinstance(expert.ops, NativeCpuOps):
            return "the layer's ops are not the native CPU kernels"
        for lin in (expert.gate_up_proj, expert.down_proj):
            if lin.quant.native_kernel is None or lin.bias is not None or getattr(lin, "lora", None) is not None:
                return f"an expert's {lin.quant.name} weights have no native kernel"
    return None


def _operands(lin: LinearBase) -> tuple[tuple[str, str], torch.Tensor, int]:
    kernel = lin.quant.native_kernel
    assert kernel is not None
    weights, fmt = lin.quant.native_operands(lin)
    return kernel, weights, fmt


def native_experts(layer: FusedMoE) -> moe_mlp.NativeExperts:
    """The layer's held experts as one native call (``why_not_native(layer)`` must be None)."""
    experts = [
        moe_mlp.ExpertWeights(_operands(ex.gate_up_proj), _operands(ex.down_proj)) for ex in layer.experts.values()
    ]
    first = layer.placement.first
    width = next(iter(layer.experts.values())).down_proj.in_features
    hidden = next(iter(layer.experts.values())).down_proj.out_features
    return moe_mlp.NativeExperts(hidden, width, layer.top_k, layer.num_experts, first, experts)
