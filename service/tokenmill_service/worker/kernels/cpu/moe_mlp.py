"""A mixture-of-experts layer's experts in one native call (moe_mlp.cpp): grouping by expert, each
expert's products (and their biases, where the family has them) and activation, and the combine in
each token's rank order.

The Python loop of ``worker/layers/fused_moe/layer.py`` costs some 50 tensor operations a layer a step at
top-8 routing, more than the experts' own arithmetic at one decoding sequence. ``NativeExperts`` runs
the same kernels on the same rows in the same order from native code, so its result is the loop's
bit for bit (tests/kernels/test_fused_moe.py holds it to that).
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tokenmill_service.worker.kernels.cpu import abi, build

if TYPE_CHECKING:
    from tokenmill_service.worker.kernels.moe_routing import GroupedTopK

_Linear, _Experts = abi.structure("TmLinear"), abi.structure("TmExperts")


def _lib() -> ctypes.CDLL:
    return build.load("moe_mlp")


def unavailable_reason() -> str | None:
    for name in ("moe_mlp", "elementwise"):
        if (reason := build.unavailable_reason(name)) is not None:
            return reason
    return None


def route(logits: torch.Tensor, top_k: int, routing: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's choice (moe_mlp.cpp's ``tm_moe_route``): logits [T, experts] float32 -> (weights float32,
    expert ids int64) [T, top_k] by rank; ``routing`` (abi.ROUTING_MODES): softmax top-k ("softmax"),
    renormalized ("renormalized"), or softmax over the top-k logits ("top_logits"); ties ranked as torch.topk."""
    t, experts = logits.shape
    assert logits.dtype == torch.float32 and logits.device.type == "cpu" and 0 < top_k <= experts
    logits = logits.contiguous()
    weights, ids = torch.empty(t, top_k), torch.empty(t, top_k, dtype=torch.int64)
    mode = abi.ROUTING_MODES[routing]
    _lib().tm_moe_route(logits.data_ptr(), t, experts, top_k, mode, weights.data_ptr(), ids.data_ptr())
    return weights, ids


def route_grouped(
    logits: torch.Tensor, score_bias: torch.Tensor, top_k: int, renormalize: bool, routing: GroupedTopK
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's group-limited sigmoid routing (moe_mlp.cpp's ``tm_moe_route_grouped``, worker/kernels/moe_routing.py's
    ``select_experts_grouped`` in native code): logits [T, experts] float32, the score-correction bias
    [experts] float32 -> (weights float32, expert ids int64) [T, top_k] by rank; ties ranked as torch.topk."""
    t, experts = logits.shape
    assert logits.dtype == score_bias.dtype == torch.float32 and logits.device.type == "cpu"
    routing.check(experts, top_k)
    logits, score_bias = logits.contiguous(), score_bias.contiguous()
    weights, ids = torch.empty(t, top_k), torch.empty(t, top_k, dtype=torch.int64)
    _lib().tm_moe_route_grouped(
        logits.data_ptr(), t, experts, top_k, score_bias.data_ptr(), routing.n_group, routing.topk_group,
        int(renormalize), routing.scaling, weights.data_ptr(), ids.data_ptr(),
    )  # fmt: skip
    return weights, ids


@dataclass(frozen=True, slots=True)
class ExpertWeights:
    """One expert's products: each a native ``kernel`` (library, symbol) reading ``weights`` in ``fmt``,
    and the biases added after them (float32; None: none)."""

    gate_up: tuple[tuple[str, str], torch.Tensor, int]  # [2 * width, hidden]: gate rows, then up rows
    down: tuple[tuple[str, str], torch.Tensor, int]  # [hidden, width]
    gate_up_bias: torch.Tensor | None = None  # [2 * width]
    down_bias: torch.Tensor | None = None  # [hidden]


class NativeExperts:
    """``experts(x, weights, ids)``: float32 [T, hidden], the weighted sum of each token's experts;
    their activation SiLU-and-mul, or gpt-oss's clamped SwiGLU where ``swiglu`` gives its (alpha, limit)."""

    def __init__(
        self,
        hidden: int,
        width: int,
        top_k: int,
        num_experts: int,
        first: int,
        experts: list[ExpertWeights],
        swiglu: tuple[float, float] | None = None,
    ) -> None:
        if not experts or first < 0 or first + len(experts) > num_experts:
            raise ValueError(f"experts {first}..{first + len(experts) - 1} are not among the {num_experts}")
        for ex in experts:
            for _, weights, _ in (ex.gate_up, ex.down):
                if weights.device.type != "cpu" or not weights.is_contiguous():
                    raise ValueError("the native experts read contiguous CPU weights")
            for bias, size in ((ex.gate_up_bias, 2 * width), (ex.down_bias, hidden)):
                if bias is not None and (
                    bias.dtype != torch.float32 or bias.device.type != "cpu" or bias.shape != (size,)
                    or not bias.is_contiguous()
                ):  # fmt: skip
                    raise ValueError(f"the native experts add contiguous float32 CPU biases of {size}")
        self._held = experts  # keeps the weights the native side points into alive

        def linear(spec: tuple[tuple[str, str], torch.Tensor, int], out_features: int) -> ctypes.Structure:
            kernel, weights, fmt = spec
            return _Linear(build.address(*kernel), weights.data_ptr(), fmt, out_features)

        self._gate_up = (_Linear * len(experts))(*(linear(ex.gate_up, 2 * width) for ex in experts))
        self._down = (_Linear * len(experts))(*(linear(ex.down, hidden) for ex in experts))

        def biases(tensors: list[torch.Tensor | None]) -> ctypes.Array[ctypes.c_void_p] | None:
            if all(b is None for b in tensors):
                return None
            return (ctypes.c_void_p * len(tensors))(*(None if b is None else b.data_ptr() for b in tensors))

        self._gate_up_bias = biases([ex.gate_up_bias for ex in experts])
        self._down_bias = biases([ex.down_bias for ex in experts])
        alpha, limit = swiglu or (0.0, 0.0)
        self._spec = _Experts(
            hidden, width, top_k, num_experts, first, len(experts),
            ctypes.addressof(self._gate_up), ctypes.addressof(self._down),
            build.address("elementwise", "tm_silu_and_mul"),
            None if self._gate_up_bias is None else ctypes.addressof(self._gate_up_bias),
            None if self._down_bias is None else ctypes.addressof(self._down_bias),
            None if swiglu is None else build.address("elementwise", "tm_clamped_swiglu_and_mul"),
            alpha, limit,
        )  # fmt: skip
        self.hidden, self.width, self.top_k, self.num_experts = hidden, width, top_k, num_experts
        self._workspace = torch.empty(0)
        self._lock = threading.Lock()  # one call at a time: they share the workspace

    def address(self) -> int:
        """Where the experts' TmExperts struct is (for the decoder stack, which calls moe_mlp.cpp with it)."""
        return ctypes.addressof(self._spec)

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        t, hidden = x.shape
        assert x.dtype == torch.float32 and x.device.type == "cpu" and hidden == self.hidden
        assert weights.shape == ids.shape == (t, self.top_k)
        x = x.contiguous()
        weights = weights.to(torch.float32).contiguous()
        ids = ids.to(torch.int64).contiguous()
        out = torch.empty(t, hidden)
        threads = torch.get_num_threads()
        with self._lock:
            need = int(_lib().tm_moe_workspace(ctypes.byref(self._spec), t, threads))
            if self._workspace.numel() < need:
                self._workspace = torch.empty(need)
            rc = _lib().tm_moe_mlp(
                ctypes.byref(self._spec), x.data_ptr(), t, ids.data_ptr(), weights.data_ptr(),
                self._workspace.data_ptr(), out.data_ptr(), threads,
            )  # fmt: skip
        if rc:
            raise RuntimeError(f"the native experts failed (code {rc})")
        return out
