"""A Q4_K_M-style GGUF (Q4_K layers; Q6_K for the output head, some v projections and down projections) as
served by default: every layer's super-blocks multiplied as stored by the native k-quant kernel, in the
native decoder stack, within the fast default's bounds of the float32 reference on its dequantized
weights, with a sequence's results bitwise the same alone or in a batch, prefilled or decoded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType

from tests.engine.test_gguf_loader import (  # noqa: F401 - q4_k_m_files is a fixture
    KQ_LAYERS,
    KQ_VOCAB,
    _kquant_tensors,
    _shape_of,
    _write_llama,
    q4_k_m_files,
    random_blocks,
)
from tokenmill_service.contract.plan import LoadOptions
from tokenmill_service.worker.engine.model_runner import ModelRunner, StepPlan, forward_prompt
from tokenmill_service.worker.kernels.cpu import decoder_stack, kquant_gemm
from tokenmill_service.worker.loader import load

pytestmark = pytest.mark.skipif(
    kquant_gemm.unavailable_reason() is not None or decoder_stack.unavailable_reason() is not None,
    reason="native kernels unavailable",
)
PROMPT = torch.randint(0, KQ_VOCAB, (41,), generator=torch.Generator().manual_seed(3)).tolist()


@pytest.fixture(scope="module")
def served(q4_k_m_files: tuple[Path, Path]) -> Any:  # noqa: F811 - the fixture imported above
    return load(LoadOptions(model=str(q4_k_m_files[0])))


def test_every_layer_is_multiplied_as_stored_in_the_native_stack(served: Any) -> None:
    plan = served.plan
    assert plan.method_counts == {"gguf-kquant": KQ_LAYERS * 4 + 1}
    assert plan.executor.value == "native-stack"
    # Layer 0's q/k/v is stored Q4_K (q, k) and Q6_K (v): one layer of two segments.
    assert plan.quant_reasons["gguf-kquant"] == "the GGUF file's blocks (Q4_K/Q6_K, Q4_K, Q6_K), multiplied as stored"
    qkv = served.model.layers[0].self_attn.qkv_proj
    assert qkv.fmt == kquant_gemm.MIXED and qkv.formats == "Q4_K/Q6_K"


@torch.inference_mode()
def test_prompt_logprobs_are_within_the_defaults_bounds_of_the_dequantized_reference(
    served: Any,
    q4_k_m_files: tuple[Path, Path],  # noqa: F811
) -> None:
    reference = load(LoadOptions(model=str(q4_k_m_files[1]), quantization="none", dtype="float32"))
    got = torch.log_softmax(served.compute_logits(forward_prompt(served, PROMPT)), -1)
    want = torch.log_softmax(reference.compute_logits(forward_prompt(reference, PROMPT)), -1)
    # The logprob of each next prompt token, as prompt logprobs report them.
    targets = torch.tensor(PROMPT[1:])
    error = (got[:-1].gather(1, targets[:, None]) - want[:-1].gather(1, targets[:, None])).abs()
    assert want.std() > 0.2  # distributions far from flat
    assert error.mean() < 1e-3 and error.max() < 1e-2, (error.mean().item(), error.max().item())


@torch.inference_mode()
def test_the_native_stack_gives_the_python_forwards_bits(served: Any) -> None:
    tables = [[0, 1, 2], [3, 4]]
    steps = [
        StepPlan(PROMPT[:30] + PROMPT[:9], [30, 9], [0, 0], tables, [29, 38], [(0, 30)]),
        StepPlan([5, 6], [1, 1], [30, 9], tables, [0, 1], []),
    ]
    results = []
    for executor in ("eager", "native-stack"):
        runner = ModelRunner(served, block_size=16, num_blocks=8, executor=executor)
        results.append([t for plan in steps for logits, prompt in [runner.execute(plan)] for t in (logits, *prompt)])
    for python, native in zip(*results):
        assert torch.equal(python, native)


@torch.inference_mode()
def test_a_sequence_is_bitwise_the_same_alone_and_in_a_batch_prefilled_or_decoded(served: Any) -> None:
    p, a, b = PROMPT[:13], PROMPT[20:29], PROMPT[30:35]
    alone = ModelRunner(served, block_size=4, num_blocks=16)
    table = [9, 3, 12, 5]
    _, (prefill,) = alone.execute(StepPlan(p, [13], [0], [table], [12], [(0, 13)]))
    decode, _ = alone.execute(StepPlan([7], [1], [13], [table], [0], []))

    crowd = ModelRunner(served, block_size=4, num_blocks=16)
    tables = [[0, 7, 2], [11, 4, 15, 6], [14, 1]]
    _, (crowd_prefill,) = crowd.execute(StepPlan(a + p + b, [9, 13, 5], [0, 0, 0], tables, [8, 21, 26], [(9, 13)]))
    crowd_decode, _ = crowd.execute(StepPlan([3, 7, 4], [1, 1, 1], [9, 13, 5], tables, [0, 1, 2], []))
    assert torch.equal(crowd_prefill, prefill)
    assert torch.equal(crowd_decode[1], decode[0])

    # The same prompt decoded token by token gives the prefill's logits for its last position.
    stepwise = ModelRunner(served, block_size=4, num_blocks=16)
    for i, token in enumerate(p):
        logits, _ = stepwise.execute(StepPlan([token], [1], [i], [table], [0], []))
    assert torch.equal(logits[0], prefill[-1])


@torch.inference_mode()
def test_the_embedding_table_stays_as_the_file_stores_it(served: Any, q4_k_m_files: tuple[Path, Path]) -> None:  # noqa: F811
    """No float32 copy of the table (a Llama-3 vocabulary's is 1 to 2 GB): the looked-up rows are
    dequantized from the file's blocks, to exactly the values of the dense table."""
    assert served.plan.embed_dtype == "gguf-blocks"
    embedding = served.model.embed_tokens
    assert embedding.weight.numel() == 0 and embedding.blocks is not None
    dense = load(LoadOptions(model=str(q4_k_m_files[0]), quantization="none", dtype="float32")).model.embed_tokens
    assert dense.blocks is None and dense.weight.shape == (KQ_VOCAB, 256)
    ids = torch.tensor(PROMPT)
    assert torch.equal(embedding(ids), dense(ids))


def test_a_file_of_the_other_k_quants_and_32_weight_formats_is_served_natively_within_bounds(tmp_path: Path) -> None:
    """Q3_K, Q5_0, IQ4_NL, Q5_1, Q2_K and IQ4_XS beside Q4_K and Q6_K: every layer on a
    native kernel, within the default's bounds of the reference on the file's dequantized weights."""
    rng = np.random.default_rng(5)
    tensors = _kquant_tensors(rng)
    swaps = {"attn_k": (QType.Q3_K, 1e-3), "ffn_gate": (QType.Q3_K, 1e-3), "ffn_up": (QType.Q3_K, 1e-3)}
    swaps |= {"blk.0.attn_output": (QType.Q5_0, 6e-3), "blk.1.attn_output": (QType.IQ4_NL, 8e-4)}
    swaps |= {"blk.1.ffn_down": (QType.IQ4_XS, 3e-5), "blk.0.ffn_down": (QType.Q2_K, 2e-3)}
    swaps |= {"blk.1.ffn_gate": (QType.Q5_1, 1e-3), "blk.1.ffn_up": (QType.Q5_1, 1e-3)}  # after the Q3_K ones
    for name, (data, qtype) in list(tensors.items()):
        for part, (new, scale) in swaps.items():
            if name.endswith(f"{part}.weight"):
                tensors[name] = (random_blocks(new, *_shape_of(data, qtype), rng, scale), new)
    path = tmp_path / "tiny-q3_k_m.gguf"
    _write_llama(path, tensors)
    served = load(LoadOptions(model=str(path)))
    plan = served.plan
    assert set(plan.method_counts) <= {"gguf-kquant", "gguf-vnni"}, plan.quant_reasons
    assert plan.method_counts == {"gguf-kquant": KQ_LAYERS * 3, "gguf-vnni": KQ_LAYERS + 1}
    assert "Q3_K/Q4_K" in plan.quant_reasons["gguf-kquant"] and "IQ4_XS" in plan.quant_reasons["gguf-kquant"]
    assert "Q2_K" in plan.quant_reasons["gguf-kquant"]
    assert all(f in plan.quant_reasons["gguf-vnni"] for f in ("Q5_0", "IQ4_NL", "Q5_1"))
    assert "as Q8_0" not in plan.quant_reasons["gguf-vnni"]
    dequantized = {
        name: (data if qtype == QType.F32 else gguf.quants.dequantize(data, qtype), QType.F32)
        for name, (data, qtype) in tensors.items()
    }
    _write_llama(tmp_path / "tiny-f32.gguf", dequantized)
    reference = load(LoadOptions(model=str(tmp_path / "tiny-f32.gguf"), quantization="none", dtype="float32"))
    with torch.inference_mode():
        got = torch.log_softmax(served.compute_logits(forward_prompt(served, PROMPT)), -1)
        want = torch.log_softmax(reference.compute_logits(forward_prompt(reference, PROMPT)), -1)
    targets = torch.tensor(PROMPT[1:])[:, None]
    error = (got[:-1].gather(1, targets) - want[:-1].gather(1, targets)).abs()
    assert want.std() > 0.2
    assert error.mean() < 1e-3 and error.max() < 1e-2, (error.mean().item(), error.max().item())
