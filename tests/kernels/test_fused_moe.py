"""The mixture-of-experts layer against its plain-torch definition (worker/layers/fused_moe/reference.py), for
each way its experts can be stored: float32 rows and GGUF blocks multiplied by tokenmill's native
kernels (float32, VNNI, k-quants), as the dense layers multiply them; the router's choice and
renormalization; DeepSeek-V3's grouped sigmoid routing against transformers' router; and a token's
output bitwise the same whatever other tokens share its step, with either routing. The experts' one
native call against their Python loop, bit for bit: SiLU-and-mul experts, and gpt-oss's (biases, the
clamped SwiGLU; float32 and MXFP4 weights)."""

from __future__ import annotations

from typing import cast

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from gguf import quants

from tests.engine.test_gguf_loader import random_blocks
from tokenmill_service.worker.device import probe_device
from tokenmill_service.worker.distributed.parallel import TensorParallel
from tokenmill_service.worker.kernels import get_ops
from tokenmill_service.worker.kernels.cpu import moe_mlp
from tokenmill_service.worker.layers.fused_moe import (
    ExpertPlacement,
    FusedMoE,
    GroupedTopK,
    select_experts,
    select_experts_grouped,
    select_top_logits,
)
from tokenmill_service.worker.layers.fused_moe.layer import ExpertMLP
from tokenmill_service.worker.layers.fused_moe.native import activation_gap, native_experts
from tokenmill_service.worker.layers.fused_moe.reference import moe_reference
from tokenmill_service.worker.layers.linear import LinearBase
from tokenmill_service.worker.layers.quant import QuantMethod, quant_method_class
from tokenmill_service.worker.layers.quant.gguf_blocks import CheckpointTensor, GGUFBlocks
from tokenmill_service.worker.models.gpt_oss import GptOssExpert, GptOssMoE

EXPERTS, TOP_K = 8, 2

# (method, how the experts are stored, hidden, width): the k-quants need whole super-blocks of 256.
CASES = [
    ("none", QType.F32, 64, 96),
    ("gguf", QType.Q8_0, 64, 96),
    ("gguf", QType.Q4_0, 64, 96),
    ("gguf-vnni", QType.Q4_1, 64, 96),
    ("gguf-kquant", QType.Q4_K, 256, 256),
]


def _stored(weight: torch.Tensor, qtype: QType) -> CheckpointTensor:
    if qtype == QType.F32:
        return weight
    if qtype == QType.Q4_K:  # gguf cannot quantize to k-quants: random valid super-blocks, small scales
        seed = int(weight.abs().sum() * 1000) % 2**31
        raw = random_blocks(qtype, weight.shape[0], weight.shape[1], np.random.default_rng(seed), scale=0.01)
    else:
        raw = quants.quantize(weight.numpy(), qtype)
    return GGUFBlocks.from_raw(raw, qtype, (weight.shape[0], weight.shape[1]))


def _moe(
    method: str, qtype: QType, hidden: int, width: int, renormalize: bool = True, grouped: GroupedTopK | None = None
) -> FusedMoE:
    facts = probe_device("cpu")
    if (why := quant_method_class(method).unavailable_reason(facts, torch.float32)) is not None:
        pytest.skip(f"{method}: {why}")

    def quant(prefix: str) -> QuantMethod:
        name = "none" if prefix.endswith(".gate") else method  # the router: float32 rows
        return quant_method_class(name)(torch.float32)

    ops = get_ops("native" if facts.native("elementwise") is None else "torch")
    moe = FusedMoE(hidden, width, EXPERTS, TOP_K, renormalize, "mlp", ops, quant, TensorParallel(), grouped)
    gen = torch.Generator().manual_seed(hidden + width)
    moe.gate.load_weight(torch.randn(EXPERTS, hidden, generator=gen))
    if moe.score_bias is not None:
        moe.score_bias.copy_(torch.randn(EXPERTS, generator=gen) * 0.1)
    for expert in moe.experts.values():
        expert.gate_up_proj.load_weight(_stored(torch.randn(width, hidden, generator=gen) * 0.1, qtype), 0)
        expert.gate_up_proj.load_weight(_stored(torch.randn(width, hidden, generator=gen) * 0.1, qtype), 1)
        expert.down_proj.load_weight(_stored(torch.randn(hidden, width, generator=gen) * 0.1, qtype))
    for module in moe.modules():
        if isinstance(module, LinearBase):
            module.finalize()
    moe.one_call = _one_call(moe)
    return moe


def _one_call(moe: FusedMoE) -> bool:
    """What the load plan answers for these experts (worker/plan/executor.py's ``experts_path``): one call where the
    ops are native, the call is built and every expert's products have a native kernel."""
    products = [lin for e in moe.experts.values() for lin in (e.gate_up_proj, e.down_proj)]
    return (
        moe.ops.name == "native"
        and moe_mlp.unavailable_reason() is None
        and all(lin.quant.native_kernel is not None for lin in products)
    )


def _reference(moe: FusedMoE, x: torch.Tensor) -> torch.Tensor:
    """The definition, on the weights as the layer's kernels see them (dequantized)."""
    experts = [moe.experts[str(e)] for e in range(EXPERTS)]
    gate_up = torch.stack([e.gate_up_proj.quant.dequantized(e.gate_up_proj) for e in experts])
    down = torch.stack([e.down_proj.quant.dequantized(e.down_proj) for e in experts])
    return moe_reference(x, moe.gate.quant.dequantized(moe.gate), gate_up, down, TOP_K, moe.renormalize)


@pytest.mark.parametrize(("method", "qtype", "hidden", "width"), CASES, ids=lambda v: getattr(v, "name", str(v)))
@torch.inference_mode()
def test_the_layer_is_its_definition_on_the_weights_its_kernels_see(
    method: str, qtype: QType, hidden: int, width: int
) -> None:
    moe = _moe(method, qtype, hidden, width)
    x = torch.randn(37, hidden, generator=torch.Generator().manual_seed(1))
    got, want = moe(x), _reference(moe, x)
    # float32 products in another order; the VNNI and k-quant kernels' 16-bit fixed-point activations.
    tol = 1e-5 if method in ("none", "gguf") else 2e-3
    assert (got - want).abs().max() <= tol * want.abs().max(), (got - want).abs().max()


@pytest.mark.parametrize(("method", "qtype", "hidden", "width"), CASES, ids=lambda v: getattr(v, "name", str(v)))
@torch.inference_mode()
def test_a_tokens_output_is_bitwise_the_same_alone_and_among_others(
    method: str, qtype: QType, hidden: int, width: int
) -> None:
    """Alone, a token's experts see one row; among 40 tokens their groups are larger and ordered otherwise."""
    moe = _moe(method, qtype, hidden, width)
    x = torch.randn(40, hidden, generator=torch.Generator().manual_seed(2))
    crowd = moe(x)
    for i in (0, 17, 39):
        assert torch.equal(moe(x[i : i + 1])[0], crowd[i])
    assert torch.equal(moe(x[10:13]), crowd[10:13])


def _loop(moe: FusedMoE, x: torch.Tensor, held: range | None = None) -> torch.Tensor:
    """The layer's Python loop (its experts one by one), of the experts in ``held`` (None: all)."""
    saved, moe.one_call = moe.one_call, False  # the loop, for comparison
    saved_experts = moe.experts
    if held is not None:
        moe.experts = torch.nn.ModuleDict({str(e): moe.experts[str(e)] for e in held})
        moe.placement = ExpertPlacement(held.start, len(held), moe.placement.expert_tp)
    try:
        return moe(x)
    finally:
        moe.one_call, moe.experts = saved, saved_experts
        moe.placement = ExpertPlacement.for_rank(EXPERTS, moe.tp)


@pytest.mark.parametrize(("method", "qtype", "hidden", "width"), CASES, ids=lambda v: getattr(v, "name", str(v)))
@torch.inference_mode()
def test_the_native_experts_are_the_loops_bits(method: str, qtype: QType, hidden: int, width: int) -> None:
    """One native call a layer (worker/kernels/cpu/moe_mlp.cpp) against the Python loop over the experts: the
    same kernels on the same rows, so the same bits, whether the experts share the threads (many tokens)
    or each product does (one token: two experts), and with only some experts held (expert parallel)."""
    moe = _moe(method, qtype, hidden, width)
    if not moe.one_call:
        pytest.skip("the experts' native call cannot run here")
    assert moe.native() is not None
    x = torch.randn(37, hidden, generator=torch.Generator().manual_seed(3))
    for rows in (x[:1], x[:3], x):
        assert torch.equal(moe(rows), _loop(moe, rows))
    weights, ids = moe.route(moe.gate(x))
    held = range(2, 5)
    subset = native_experts(moe)
    part = type(subset)(
        hidden, width, TOP_K, EXPERTS, held.start, [subset._held[e] for e in held]
    )  # the experts of rank 1 of an expert-parallel layer
    assert torch.equal(part(x, weights, ids), _loop(moe, x, held))


def _gpt_oss_moe(method: str, qtype: QType, tp: TensorParallel) -> GptOssMoE:
    """gpt-oss's layer (router with a bias, top-k then softmax; experts with biases and the clamped
    SwiGLU), hidden 64, width 128: biases large enough that gate and up pass the limit both ways."""
    facts = probe_device("cpu")
    if (why := quant_method_class(method).unavailable_reason(facts, torch.float32)) is not None:
        pytest.skip(f"{method}: {why}")

    def quant(prefix: str) -> QuantMethod:
        return quant_method_class("none" if prefix.endswith(".gate") else method)(torch.float32)

    hidden, width = 64, 128
    ops = get_ops("native" if facts.native("elementwise") is None else "torch")
    moe = GptOssMoE(hidden, width, EXPERTS, TOP_K, True, "mlp", ops, quant, tp)
    gen = torch.Generator().manual_seed(7)
    rng = np.random.default_rng(7)

    def stored(rows: int, cols: int) -> CheckpointTensor:
        if qtype == QType.F32:
            return torch.randn(rows, cols, generator=gen) * 0.1
        raw = random_blocks(QType.MXFP4, rows, cols, rng).reshape(rows, cols // 32, 17)
        raw[..., 0] = rng.integers(120, 124, size=raw.shape[:-1], dtype=np.uint8)  # 2^-8 .. 2^-5
        return GGUFBlocks.from_raw(raw.reshape(rows, -1), QType.MXFP4, (rows, cols))

    moe.gate.load_weight(torch.randn(EXPERTS, hidden, generator=gen))
    moe.gate.load_bias(torch.randn(EXPERTS, generator=gen))
    for expert in moe.experts.values():
        cast(GptOssExpert, expert).swiglu = (1.702, 7.0)
        for shard in (0, 1):
            expert.gate_up_proj.load_weight(stored(width, hidden), shard)
            expert.gate_up_proj.load_bias(torch.randn(width, generator=gen) * 4, shard)
        expert.down_proj.load_weight(stored(hidden, width))
        expert.down_proj.load_bias(torch.randn(hidden, generator=gen))
    for module in moe.modules():
        if isinstance(module, LinearBase):
            module.finalize()
    moe.one_call = _one_call(moe)
    return moe


@pytest.mark.parametrize(
    ("method", "qtype"),
    [("none", QType.F32), ("gguf", QType.MXFP4), ("gguf-vnni", QType.MXFP4)],
    ids=["F32", "MXFP4", "MXFP4-vnni"],
)
@torch.inference_mode()
def test_gpt_oss_native_experts_are_the_loops_bits(method: str, qtype: QType) -> None:
    """gpt-oss's experts (each product's bias, the clamped SwiGLU) in one native call against its loop:
    the same bits at 1, 3 and 37 tokens, for the experts of one expert-parallel rank, and for each rank
    of two splitting every expert's width (the down bias on the first rank only, once in the sum)."""
    moe = _gpt_oss_moe(method, qtype, TensorParallel())
    if not moe.one_call:
        pytest.skip("the experts' native call cannot run here")
    assert moe.native() is not None
    x = torch.randn(37, 64, generator=torch.Generator().manual_seed(8))
    gate_up = moe.experts["0"].gate_up_proj(x)
    assert (gate_up[:, :128] > 7).any() and (gate_up[:, 128:] > 7).any() and (gate_up[:, 128:] < -7).any()
    for rows in (x[:1], x[:3], x):
        assert torch.equal(moe(rows), _loop(moe, rows))
    weights, ids = moe.route(moe.gate(x))
    held = range(2, 5)
    subset = native_experts(moe)
    part = type(subset)(64, 128, TOP_K, EXPERTS, held.start, [subset._held[e] for e in held], (1.702, 7.0))
    assert torch.equal(part(x, weights, ids), _loop(moe, x, held))
    for rank in (0, 1):  # no all-reduce here: each rank's partial sums
        split = _gpt_oss_moe(method, qtype, TensorParallel(rank, 2))
        assert split.native() is not None
        assert torch.equal(native_experts(split)(x, weights, ids), split.experts_loop(x, weights, ids))


def test_experts_with_an_activation_of_no_native_form_run_one_by_one() -> None:
    class GeluExpert(ExpertMLP):
        def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
            return self.ops.gelu_tanh_and_mul(gate_up)

    class GeluMoE(FusedMoE):
        expert_type = GeluExpert

    quant = lambda _: quant_method_class("none")(torch.float32)
    moe = GeluMoE(64, 64, 4, 2, True, "mlp", get_ops("torch"), quant, TensorParallel())
    assert activation_gap(GeluMoE) == "GeluExpert has an activation the native call does not compute"
    with pytest.raises(ValueError, match="GeluExpert has an activation the native call does not compute"):
        native_experts(moe)


def test_the_router_takes_the_top_k_by_softmax_largest_first_renormalized_or_not() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 3.5, -2.0, 0.5]])
    weights, ids = select_experts(logits, 2, renormalize=False)
    probs = torch.softmax(logits, -1)
    assert ids.tolist() == [[1, 2], [1, 0]]
    torch.testing.assert_close(weights, probs.gather(1, ids))
    renormalized, same_ids = select_experts(logits, 2, renormalize=True)
    assert torch.equal(same_ids, ids)
    torch.testing.assert_close(renormalized, weights / weights.sum(-1, keepdim=True))
    torch.testing.assert_close(renormalized.sum(-1), torch.ones(2))


# (experts, top_k): torch.topk's two selections, std::partial_sort where top_k * 64 <= experts
# (128, 2; 256, 4), else std::nth_element (OLMoE's 64, 8; Mixtral's 8, 2; every expert; one).
ROUTER_SHAPES = [(4, 2), (8, 2), (60, 4), (64, 8), (128, 2), (256, 4), (16, 1), (8, 8)]


@pytest.mark.parametrize(("experts", "top_k"), ROUTER_SHAPES)
def test_the_native_router_chooses_as_torch_and_ranks_equal_scores_as_torch_topk(experts: int, top_k: int) -> None:
    """moe_mlp.cpp's routings (the native ops' and the native decoder stack's router: softmax top-k,
    renormalized or not, and gpt-oss's softmax over the top-k logits) against worker/kernels/moe_routing.py's torch ones:
    logits from a few levels, so most rows hold equal values, which must come out in torch.topk's order;
    the weights within float32 rounding; each row the same alone."""
    from tokenmill_service.worker.kernels.cpu import moe_mlp

    if (why := moe_mlp.unavailable_reason()) is not None:
        pytest.skip(why)
    gen = torch.Generator().manual_seed(experts * 100 + top_k)
    for levels in (2, 5, 1 << 20):
        logits = torch.randint(0, levels, (64, experts), generator=gen).float() * (3.0 / levels)
        for routing in ("softmax", "renormalized", "top_logits"):
            weights, ids = moe_mlp.route(logits, top_k, routing)
            if routing == "top_logits":
                want_weights, want_ids = select_top_logits(logits, top_k)
            else:
                want_weights, want_ids = select_experts(logits, top_k, routing == "renormalized")
            assert torch.equal(ids, want_ids), (levels, routing)
            torch.testing.assert_close(weights, want_weights, atol=1e-6, rtol=1e-5)
            alone_weights, alone_ids = moe_mlp.route(logits[5:6], top_k, routing)
            assert torch.equal(alone_weights[0], weights[5]) and torch.equal(alone_ids[0], ids[5])


@torch.inference_mode()
def test_without_renormalization_the_outputs_are_the_smaller_weights_ones() -> None:
    normed, plain = _moe("none", QType.F32, 64, 96, True), _moe("none", QType.F32, 64, 96, False)
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(3))
    weights, _ = select_experts(x @ normed.gate.weight.t(), TOP_K, renormalize=False)
    total = weights.sum(-1, keepdim=True)  # < 1: what renormalizing divides by
    torch.testing.assert_close(plain(x), normed(x) * total, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(plain(x), _reference(plain, x), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(("groups", "kept", "top_k", "norm"), [(2, 1, 2, True), (4, 2, 3, False), (1, 1, 4, True)])
@torch.inference_mode()
def test_the_grouped_router_is_transformers_deepseek_v3_router(groups: int, kept: int, top_k: int, norm: bool) -> None:
    """Sigmoid scores, the correction bias for choosing only, the best groups by their two best, the top-k
    among them, weights from the uncorrected scores (renormalized or not) times the scaling factor."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = transformers.DeepseekV3Config(
        hidden_size=32, n_routed_experts=8, n_group=groups, topk_group=kept, num_experts_per_tok=top_k,
        norm_topk_prob=norm, routed_scaling_factor=2.5,
    )  # fmt: skip
    router = DeepseekV3TopkRouter(config)
    gen = torch.Generator().manual_seed(groups)
    router.weight.copy_(torch.randn(8, 32, generator=gen))
    router.e_score_correction_bias.copy_(torch.randn(8, generator=gen) * 0.3)
    x = torch.randn(50, 32, generator=gen)
    _, want_weights, want_ids = router(x)
    routing = GroupedTopK(groups, kept, 2.5)
    weights, ids = select_experts_grouped(x @ router.weight.t(), router.e_score_correction_bias, top_k, norm, routing)
    # transformers leaves its top-k unsorted: compare each token's experts as a set, weights by expert.
    assert torch.equal(ids.sort(-1).values, want_ids.sort(-1).values)
    torch.testing.assert_close(weights.gather(1, ids.argsort(-1)), want_weights.gather(1, want_ids.argsort(-1)))
    kept_groups = (ids // (8 // groups)).tolist()
    assert all(len(set(row)) <= kept for row in kept_groups)


@pytest.mark.parametrize(
    ("experts", "groups", "kept", "top_k"), [(8, 2, 1, 2), (8, 4, 2, 3), (64, 8, 4, 8), (16, 1, 1, 4)]
)
def test_the_native_grouped_router_chooses_as_torch(experts: int, groups: int, kept: int, top_k: int) -> None:
    """moe_mlp.cpp's grouped sigmoid routing (the native ops' and the native decoder stack's) against
    moe_routing.py's torch one: logits from a few levels (equal scores ranked as torch.topk ranks them), a
    correction bias from a few levels too, renormalized or not; the weights within float32 rounding; each
    row the same alone."""
    from tokenmill_service.worker.kernels.cpu import moe_mlp

    if (why := moe_mlp.unavailable_reason()) is not None:
        pytest.skip(why)
    gen = torch.Generator().manual_seed(experts + groups)
    routing = GroupedTopK(groups, kept, 2.5)
    for levels in (3, 1 << 20):
        logits = torch.randint(0, levels, (48, experts), generator=gen).float() * (4.0 / levels) - 2.0
        bias = torch.randint(0, 4, (experts,), generator=gen).float() * 0.1
        for norm in (True, False):
            weights, ids = moe_mlp.route_grouped(logits, bias, top_k, norm, routing)
            want_weights, want_ids = select_experts_grouped(logits, bias, top_k, norm, routing)
            assert torch.equal(ids, want_ids), (levels, norm)
            torch.testing.assert_close(weights, want_weights, atol=1e-6, rtol=1e-5)
            alone_weights, alone_ids = moe_mlp.route_grouped(logits[7:8], bias, top_k, norm, routing)
            assert torch.equal(alone_weights[0], weights[7]) and torch.equal(alone_ids[0], ids[7])


def test_grouped_routing_is_refused_where_the_groups_cannot_hold_the_experts() -> None:
    with pytest.raises(ValueError, match="do not split into 3 equal groups"):
        GroupedTopK(3, 1, 1.0).check(8, 2)
    with pytest.raises(ValueError, match="1 of 4 groups of 2 experts cannot hold 3 experts a token"):
        GroupedTopK(4, 1, 1.0).check(8, 3)


@torch.inference_mode()
def test_with_grouped_routing_a_tokens_output_is_its_definition_and_bitwise_the_same_alone() -> None:
    routing = GroupedTopK(2, 1, 2.5)
    moe = _moe("none", QType.F32, 64, 96, True, routing)
    x = torch.randn(27, 64, generator=torch.Generator().manual_seed(4))
    crowd = moe(x)
    for i in (0, 17, 26):
        assert torch.equal(moe(x[i : i + 1])[0], crowd[i])
    # 13 tokens' 104 scores: torch.sigmoid would leave the last 8 to its scalar tail, another exp.
    assert torch.equal(moe(x[9:22]), crowd[9:22])
    # The definition: every expert on every token, each token's chosen ones weighted.
    assert moe.score_bias is not None
    weights, ids = select_experts_grouped(x @ moe.gate.weight.t(), moe.score_bias, TOP_K, True, routing)
    every = torch.stack([moe.experts[str(e)](x) for e in range(EXPERTS)], 1)  # [T, E, H]
    want = (every.gather(1, ids[..., None].expand(-1, -1, 64)) * weights[..., None]).sum(1)
    torch.testing.assert_close(crowd, want, atol=1e-5, rtol=1e-5)
