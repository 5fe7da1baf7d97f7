"""The mixture-of-experts MLP by its definition, in plain torch: what ``FusedMoE`` is tested against.

Every expert on every token (no grouping), then each token's ``top_k`` outputs picked and weighted:
the slow, obvious computation, from float32 weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill_service.worker.kernels.moe_routing import select_experts


def moe_reference(
    x: torch.Tensor,
    router: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    top_k: int,
    renormalize: bool,
) -> torch.Tensor:
    """x [T, H]; router [E, H]; gate_up [E, 2I, H] (gate rows, then up rows); down [E, H, I].
    Returns float32 [T, H]: sum over each token's top_k experts of weight * down(silu(gate) * up)."""
    x = x.float()
    weights, ids = select_experts(x @ router.float().t(), top_k, renormalize)
    gate, up = torch.einsum("th,eoh->teo", x, gate_up.float()).chunk(2, dim=-1)
    every = torch.einsum("tei,ehi->teh", F.silu(gate) * up, down.float())  # [T, E, H]
    chosen = every.gather(1, ids[..., None].expand(-1, -1, every.shape[-1]))  # [T, top_k, H]
    return (chosen * weights[..., None]).sum(dim=1)
