"""A mixture-of-experts MLP: the router (softmax, or DeepSeek-V3's grouped sigmoid: worker/kernels/moe_routing.py), the
experts (each through its quantization method) and the combine in a fixed order per token (layer.py);
the plain-torch definition it is tested against (reference.py)."""

from tokenmill_service.worker.kernels.moe_routing import (
    GroupedTopK,
    select_experts,
    select_experts_grouped,
    select_top_logits,
)
from tokenmill_service.worker.layers.fused_moe.layer import ExpertPlacement, FusedMoE

__all__ = [
    "ExpertPlacement",
    "FusedMoE",
    "GroupedTopK",
    "select_experts",
    "select_experts_grouped",
    "select_top_logits",
]
