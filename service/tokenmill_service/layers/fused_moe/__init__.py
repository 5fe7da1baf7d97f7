"""A mixture-of-experts MLP: the router, the experts (each through its quantization method) and the
combine in a fixed order per token (layer.py); the plain-torch definition it is tested against
(reference.py)."""

from tokenmill_service.layers.fused_moe.layer import ExpertPlacement, FusedMoE
from tokenmill_service.layers.fused_moe.router import select_experts

__all__ = ["ExpertPlacement", "FusedMoE", "select_experts"]
