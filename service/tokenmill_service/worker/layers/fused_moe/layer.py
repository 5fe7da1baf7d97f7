"""``FusedMoE``: a mixture-of-experts MLP for one rank, batch-invariant by construction.

The layer holds the router (``gate``: a linear layer [experts, hidden], as the checkpoint names it)
and, stacked per projection, the experts this rank owns: ``experts.<id>.gate_up_proj`` (gate and up
packed, as a dense MLP's) and ``experts.<id>.down_proj``. Each expert's projection is a linear
layer with the quantization method the load plan chose for its prefix, so every format and native
kernel the dense layers serve (float32 rows, Q4_0/Q4_1/Q8_0 blocks, their VNNI form, the k-quants,
int8, int4) serves the experts unchanged; checkpoint tensors reach them by expert id through the
linear layers' ``load_weight``.

A step:

1. the router picks each token's ``top_k`` experts and weights (worker/kernels/moe_routing.py): softmax top-k (the ops
   backend's ``select_experts``: the native ops compute it in moe_mlp.cpp, as the decoder stack does), a
   softmax over the top-k logits where the family's ``top_logits`` says so (gpt-oss: ``select_top_logits``,
   moe_mlp.cpp's too), or, given a ``GroupedTopK``, DeepSeek-V3's group-limited sigmoid routing with the layer's score-correction bias
   (``gate.e_score_correction_bias`` in the checkpoint; ``score_bias`` here, float32; the ops backend's
   ``select_experts_grouped``: moe_mlp.cpp's under the native ops, as the decoder stack computes it);
2. the (token, rank) pairs are grouped by expert (a stable sort of the expert ids), and each expert
   this rank holds runs gate/up, SiLU-and-mul (or its family's activation) and down, each product
   plus its bias where the family has them, on its group's rows;
3. each token's output is ``sum_r weight_r * out_r`` over its ranks r = 0 .. top_k - 1, in that
   order, in float32.

Why a token's result does not depend on the other tokens of the step: the router is per row; each
expert's kernels compute a row independently of the rows beside it (the dense layers' promise, and
the reason the same kernels are used here); and the combine is an elementwise sum in an order fixed
by the token's own ranks, not by which expert or group came first.

How the experts run is the load plan's answer (``LoadPlan.experts``, set on the layer as ``one_call``):
one by one here (``experts_loop``), or in one call of the ops backend (``Ops.moe_experts``, given the
experts' packed weights: native.py), which runs the same kernels on the same rows in the same order
(worker/kernels/cpu/moe_mlp.cpp), so the same bits.

Parallelism over a replica's ranks (one all-reduce of the combined output per layer either way):

- tensor parallel (the default): every rank holds every expert, a slice of each one's width, as a
  dense MLP is split; the partial sums are all-reduced;
- expert parallel (``TensorParallel.expert_parallel``): each rank holds ``experts / ranks`` whole
  experts; a rank adds the terms of the experts it holds (zero for the others) and the all-reduce
  completes each token's sum.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from tokenmill_service.worker.distributed.parallel import TensorParallel, all_reduce
from tokenmill_service.worker.kernels import NativeExperts
from tokenmill_service.worker.kernels.interface import Ops
from tokenmill_service.worker.kernels.moe_routing import GroupedTopK
from tokenmill_service.worker.layers.fused_moe.native import native_experts
from tokenmill_service.worker.layers.linear import (
    MergedColumnParallelLinear,
    QuantFactory,
    ReplicatedLinear,
    RowParallelLinear,
)


@dataclass(frozen=True, slots=True)
class ExpertPlacement:
    """Which experts a rank holds, and how each is split."""

    first: int  # the first expert id held here
    count: int  # consecutive experts held here
    expert_tp: TensorParallel  # how each held expert's width is split (size 1: whole)

    @classmethod
    def for_rank(cls, num_experts: int, tp: TensorParallel) -> ExpertPlacement:
        if not tp.expert_parallel or tp.size == 1:
            return cls(0, num_experts, tp)
        if num_experts % tp.size:
            raise ValueError(f"--expert-parallel needs the experts ({num_experts}) divisible by the ranks ({tp.size})")
        count = num_experts // tp.size
        return cls(tp.rank * count, count, TensorParallel())

    @property
    def ids(self) -> range:
        return range(self.first, self.first + self.count)


class ExpertDownLinear(RowParallelLinear):
    """An expert's down projection: row-parallel, its partial sums left for the layer's one all-reduce
    (a bias, where the family has one, added by the expert's first rank only: once in the sum)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.quant.apply(self, x)
        return y if self.bias is None or self.tp.rank else y + self.bias


class ExpertMLP(nn.Module):
    """One expert: gate/up packed, SiLU-and-mul, down (no reduction). A family's experts subclass it
    for biases (``bias``) or another activation (``activation``, and ``native_activation`` where the
    native experts call computes it too)."""

    bias: ClassVar[bool] = False

    def __init__(self, hidden: int, width: int, prefix: str, ops: Ops, quant: QuantFactory, tp: TensorParallel) -> None:
        super().__init__()
        self.ops = ops
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden, [width, width], self.bias, quant(f"{prefix}.gate_up_proj"), tp
        )
        self.down_proj = ExpertDownLinear(width, hidden, self.bias, quant(f"{prefix}.down_proj"), tp)

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[T, 2 * width] (gate, up) -> [T, width]."""
        return self.ops.silu_and_mul(gate_up)

    def native_activation(self) -> tuple[float, float] | None:
        """``activation`` as the native experts call (worker/kernels/cpu/moe_mlp.cpp) computes it: None for
        SiLU-and-mul, (alpha, limit) for gpt-oss's clamped SwiGLU. A subclass with another activation
        overrides both, or its experts run one by one."""
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(self.activation(self.gate_up_proj(x)))
        return out


class FusedMoE(nn.Module):
    score_bias: torch.Tensor | None
    # A family's seams: its experts' module, whether its router has a bias, and whether it softmaxes the
    # top-k logits (``select_top_logits``) instead of taking the top-k of the softmax (both gpt-oss).
    expert_type: ClassVar[type[ExpertMLP]] = ExpertMLP
    router_bias: ClassVar[bool] = False
    top_logits: ClassVar[bool] = False

    def __init__(
        self,
        hidden: int,
        width: int,
        num_experts: int,
        top_k: int,
        renormalize: bool,
        prefix: str,
        ops: Ops,
        quant: QuantFactory,
        tp: TensorParallel,
        grouped: GroupedTopK | None = None,
    ) -> None:
        """``width``: each expert's intermediate size; ``prefix``: the layer's ("model.layers.0.mlp");
        ``grouped``: DeepSeek-V3's routing instead of softmax top-k."""
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"experts per token ({top_k}) must be between 1 and the experts ({num_experts})")
        if grouped is not None:
            grouped.check(num_experts, top_k)
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.grouped = grouped
        # The score-correction bias of grouped routing (every rank all of it; loaded by the family).
        bias = None if grouped is None else torch.zeros(num_experts, dtype=torch.float32)
        self.register_buffer("score_bias", bias, persistent=False)
        self.tp, self.ops = tp, ops
        # The load plan's answer (``LoadPlan.experts``): the experts in one ops call, or one by one.
        self.one_call = False
        self._native: NativeExperts | None = None  # their operands, made at the first step
        self.placement = ExpertPlacement.for_rank(num_experts, tp)
        self.gate = ReplicatedLinear(hidden, num_experts, self.router_bias, quant(f"{prefix}.gate"))
        # Held experts by id (a ModuleDict: the checkpoint's "experts.<id>" names land on them).
        self.experts = nn.ModuleDict(
            {
                str(e): self.expert_type(hidden, width, f"{prefix}.experts.{e}", ops, quant, self.placement.expert_tp)
                for e in self.placement.ids
            }
        )

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The router's logits [T, experts] -> (weights float32, expert ids) [T, top_k], by rank."""
        if self.top_logits:
            return self.ops.select_top_logits(logits, self.top_k)
        if self.grouped is None:
            return self.ops.select_experts(logits, self.top_k, self.renormalize)
        assert self.score_bias is not None
        return self.ops.select_experts_grouped(logits, self.score_bias, self.top_k, self.renormalize, self.grouped)

    def native(self) -> NativeExperts:
        """The held experts' packed weights, formats and biases for one call (made at the first step, after
        the weights are loaded and packed; ValueError where they do not fit it)."""
        if self._native is None:
            self._native = native_experts(self)
        return self._native

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden] in x's dtype."""
        weights, ids = self.route(self.gate(x))
        if self.one_call:
            out = self.ops.moe_experts(self.native(), x, weights, ids)
        else:
            out = self.experts_loop(x, weights, ids)
        return all_reduce(out, self.tp).to(x.dtype)

    def experts_loop(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The held experts one by one (the reference ops' way): float32 [T, hidden], each token's
        ``sum_r weights[:, r] * expert(ids[:, r])(x)``, the terms of experts held elsewhere zero."""
        tokens, hidden = x.shape
        out = torch.zeros(tokens, self.top_k, hidden, dtype=torch.float32, device=x.device)
        flat = ids.flatten()  # (token, rank) pairs, token-major
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        flat_out = out.view(tokens * self.top_k, hidden)
        start = 0
        for expert_id, count in enumerate(counts):
            if count and expert_id in self.placement.ids:
                pairs = order[start : start + count]
                flat_out[pairs] = self.experts[str(expert_id)](x[pairs // self.top_k]).float()
            start += count
        combined = out[:, 0] * weights[:, 0:1]
        for rank in range(1, self.top_k):  # the token's own ranks' order, whatever the groups were
            combined = combined + out[:, rank] * weights[:, rank : rank + 1]
        return combined
