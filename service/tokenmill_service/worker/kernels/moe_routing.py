"""The router of a mixture-of-experts layer: each token's ``top_k`` experts and their weights.

Three routings, each returning the chosen experts by rank (the largest first: that order is the order
the combine sums in) and every step a function of the token's own row, so that a token's choice does
not depend on the others in its batch:

- ``select_experts`` (Mixtral, Qwen3-MoE, OLMoE): softmax over the router's logits in float32, the
  ``top_k`` largest, renormalized to sum to 1 where the family does it (Mixtral always; Qwen3-MoE when
  ``norm_topk_prob``; OLMoE not).
- ``select_top_logits`` (gpt-oss): the ``top_k`` largest logits, then a softmax over those in float32.
- ``select_experts_grouped`` (DeepSeek-V3, ``GroupedTopK``): sigmoid scores in float32 (``row_sigmoid``);
  the score-correction bias added for choosing only; the experts split into ``n_group`` equal groups,
  each scored by the sum of its two best corrected scores, the ``topk_group`` best groups kept; the
  ``top_k`` best corrected scores among their experts; the weights are those experts' uncorrected
  scores, renormalized when ``renormalize``, times ``scaling`` (``routed_scaling_factor``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def select_experts(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, experts] -> (weights float32 [T, top_k], expert ids int64 [T, top_k]), by rank."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1, sorted=True)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def select_top_logits(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, experts] -> (weights float32 [T, top_k], expert ids int64 [T, top_k]), by rank: the top_k
    logits, softmaxed over the chosen (gpt-oss)."""
    values, ids = torch.topk(logits.float(), top_k, dim=-1, sorted=True)
    return torch.softmax(values, dim=-1), ids


@dataclass(frozen=True, slots=True)
class GroupedTopK:
    """DeepSeek-V3's group-limited sigmoid routing (``n_group``, ``topk_group``, ``routed_scaling_factor``)."""

    n_group: int
    topk_group: int
    scaling: float

    def check(self, num_experts: int, top_k: int) -> None:
        """ValueError unless the experts split into the groups and the kept groups hold ``top_k`` experts."""
        if self.n_group < 1 or num_experts % self.n_group:
            raise ValueError(f"{num_experts} routed experts do not split into {self.n_group} equal groups")
        per_group = num_experts // self.n_group
        if per_group < 2:
            raise ValueError(f"groups of {per_group} expert: a group is scored by its two best experts")
        if not 0 < self.topk_group <= self.n_group or self.topk_group * per_group < top_k:
            raise ValueError(
                f"{self.topk_group} of {self.n_group} groups of {per_group} experts cannot hold {top_k} experts a token"
            )


def row_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """sigmoid(x) = softmax((x, 0))[0], elementwise, computed the same whatever the batch.

    ``torch.sigmoid`` is elementwise over the whole flattened tensor: the elements a vectorized pass
    leaves over at its end go through a scalar exp whose last bit differs, so a token's scores
    would depend on how many tokens came before it. Softmax over a last dim of 2 computes each pair
    on its own, the same way wherever it sits (as the softmax router's rows)."""
    return torch.softmax(torch.stack((x, torch.zeros_like(x)), dim=-1), dim=-1)[..., 0]


def select_experts_grouped(
    logits: torch.Tensor, score_bias: torch.Tensor, top_k: int, renormalize: bool, routing: GroupedTopK
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, experts], score_bias [experts] -> (weights float32 [T, top_k], expert ids int64
    [T, top_k]), by rank of the corrected score."""
    scores = row_sigmoid(logits.float())
    choice = scores + score_bias.float()
    tokens, experts = choice.shape
    grouped = choice.view(tokens, routing.n_group, experts // routing.n_group)
    group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, n_group]
    kept = torch.topk(group_scores, routing.topk_group, dim=-1).indices
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
    choice = grouped.masked_fill(~group_mask[..., None], float("-inf")).view(tokens, experts)
    ids = torch.topk(choice, top_k, dim=-1, sorted=True).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routing.scaling, ids
