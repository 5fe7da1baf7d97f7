"""The router of a mixture-of-experts layer: each token's ``top_k`` experts and their weights.

Softmax over the router's logits in float32, the ``top_k`` largest (sorted, the largest first:
that order is the order the combine sums in), renormalized to sum to 1 where the family does it
(Mixtral always; Qwen3-MoE when ``norm_topk_prob``; OLMoE not). Every step is a function of the
token's own row, so a token's choice does not depend on the others in its batch.
"""

from __future__ import annotations

import torch


def select_experts(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, experts] -> (weights float32 [T, top_k], expert ids int64 [T, top_k]), by rank."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1, sorted=True)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids
