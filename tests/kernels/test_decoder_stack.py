"""The native decoder stack (worker/kernels/cpu/decoder_stack.cpp): the served model's layers in one native call.

It must give the Python forward's results bit for bit (it calls the same kernels in the same
order), over prefill chunks, decode tokens and mixed steps, with both native products; serve by
default where it can; and step aside, saying why, where it cannot (torch's int8/int4 kernels,
compiled regions). gpt-oss's layers (attention sinks, sliding windows alternating with full attention,
biases on every projection and the router, YaRN, the top-k logits softmaxed) the same, past the window,
with its windowed and global layers' separate block tables (KV-cache groups) as the engine gives them.
Gemma 2's and Gemma 3's layers (GeGLU, the sandwich norms, soft caps, the scaled embeddings, Gemma 3's
per-head q/k norms and local and global rotary tables; head_dim 256 in Gemma 3's) the same.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from structlog.testing import capture_logs

from tokenmill_service.worker.engine.kv_cache_groups import KVCacheGroups, plan_kv_cache_groups
from tokenmill_service.worker.engine.model_runner import ModelRunner, StepPlan
from tokenmill_service.worker.engine.native_stack import build_decoder_stack
from tokenmill_service.worker.kernels.attention_metadata import NULL_BLOCK
from tokenmill_service.worker.kernels.cpu import decoder_stack, vnni_gemm
from tokenmill_service.worker.models.registry import family as family_spec

pytestmark = pytest.mark.skipif(
    decoder_stack.unavailable_reason() is not None,
    reason=f"native kernels unavailable: {decoder_stack.unavailable_reason()}",
)


def _steps(vocab: int = 49152) -> Iterator[StepPlan]:
    """Three sequences: two prefills (one chunked), then decodes beside a third one's prefill."""
    gen = torch.Generator().manual_seed(3)

    def ids(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=gen).tolist()

    tables = [[0, 1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11]]
    yield StepPlan(ids(40 + 17), [40, 17], [0, 0], tables[:2], [16, 56], [(0, 40)])
    yield StepPlan(ids(1 + 23), [1, 23], [17, 40], [tables[1], tables[0]], [0, 23], [])
    for k in range(4):
        yield StepPlan(ids(1 + 1 + 9), [1, 1, 9], [63 + k, 18 + k, 9 * k], tables[:2] + [tables[2]], [0, 1, 10], [])


def _grouped(steps: Iterator[StepPlan], groups: KVCacheGroups, window: int) -> Iterator[StepPlan]:
    """``steps`` with a block table per KV-cache group, as the engine gives them: the global groups' the
    step's own, each windowed group's other blocks with those wholly behind every query's window freed
    (NULL_BLOCK), as the block manager frees them."""
    for plan in steps:
        tables = []
        for g, group_window in enumerate(groups.windows):
            for table, start in zip(plan.block_tables, plan.starts):
                if group_window is None:
                    tables.append(table)
                    continue
                seen = max(0, start + 1 - window) // 16  # the first block the step's queries can see
                tables.append([NULL_BLOCK if i < seen else 16 * (g + 1) + b for i, b in enumerate(table)])
        yield StepPlan(plan.token_ids, plan.query_lens, plan.starts, tables, plan.sample_rows, plan.prompt_rows)


def _run(model: Any, native: bool, groups: KVCacheGroups | None = None) -> list[torch.Tensor]:
    executor = "native-stack" if native else "eager"
    blocks = 16 * (groups.num_groups if groups is not None else 1)
    runner = ModelRunner(model, block_size=16, num_blocks=blocks, executor=executor, kv_groups=groups)
    steps = _steps(model.config.vocab_size)
    if groups is not None:
        steps = _grouped(steps, groups, min(w for w in groups.windows if w is not None))
    results = []
    for plan in steps:
        logits, prompt_logits = runner.execute(plan)
        results += [logits, *prompt_logits]
    return results


def same_bits(model: Any, groups: KVCacheGroups | None = None) -> list[torch.Tensor]:
    """The eager loop's and the stack's logits over ``_steps``, bitwise equal (the stack's returned)."""
    assert model.plan.executor.value == "native-stack"
    python, native = _run(model, False, groups), _run(model, True, groups)
    assert len(python) == len(native) == 7
    for a, b in zip(python, native):
        assert torch.equal(a, b), (a - b).abs().max().item()
    return native


@torch.inference_mode()
def test_the_served_model_runs_the_native_stack_with_the_python_forwards_bits(served_model: Any) -> None:
    same_bits(served_model)


@torch.inference_mode()
def test_a_prompt_whose_rows_the_threads_split_keeps_the_python_forwards_bits(served_model: Any) -> None:
    """A 400-token prompt (400 rows of 192 floats and more: past the stack's ROWS_IN_PARALLEL, so its norms,
    rotary, cache writes and activation split the rows between the threads), then a decode beside a 130-token
    chunk: the eager loop's bits, and the same bits with one thread."""
    if torch.get_num_threads() < 2:
        pytest.skip("needs two threads")
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, served_model.config.vocab_size, (400 + 1 + 130,), generator=gen).tolist()
    first = list(range(26))
    second = list(range(26, 35))
    plans = [
        StepPlan(ids[:400], [400], [0], [first], [399], [(0, 400)]),
        StepPlan(ids[400:], [1, 130], [400, 0], [first, second], [0, 130], [(1, 130)]),
    ]

    def run(executor: str) -> list[torch.Tensor]:
        runner = ModelRunner(served_model, block_size=16, num_blocks=48, executor=executor)
        out = []
        for plan in plans:
            logits, prompt_logits = runner.execute(plan)
            out += [logits, *prompt_logits]
        return out

    python, native = run("eager"), run("native-stack")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        alone = run("native-stack")
    finally:
        torch.set_num_threads(threads)
    for a, b, c in zip(python, native, alone, strict=True):
        assert torch.equal(a, b) and torch.equal(b, c), (a - b).abs().max().item()


def test_every_familys_stack_keeps_its_bits_with_each_steps_rows_split_between_the_threads() -> None:
    """The bit-for-bit tests of this file (the embedded model, gpt-oss, Gemma 2 and 3 with their q/k and sandwich
    norms, Granite, Phi-3, DeepSeek-V3) in a process whose stack splits every step's per-token operations between
    the threads however few its rows (TM_STACK_SPLIT_FROM=1; the library reads it when it loads): the tiny models'
    steps never reach the default's 64 K floats."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("needs two cores")
    env = {key: value for key, value in os.environ.items() if key != "PYTEST_ADDOPTS"}
    env["TM_STACK_SPLIT_FROM"] = "1"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "python_forwards_bits"],
        env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert " passed" in result.stdout, result.stdout[-3000:]


@torch.inference_mode()
def test_the_float32_block_product_runs_it_too(default_model_path: Path) -> None:
    from tokenmill_service.worker.loader import load_model

    with capture_logs() as logs:
        model = load_model(default_model_path, quantization="gguf")
    loaded = next(e for e in logs if e["event"] == "model_loaded")
    assert loaded["layers"] == "native stack"
    same_bits(model)


def test_the_default_is_the_native_stack_on_vnni(served_model: Any) -> None:
    if vnni_gemm.unavailable_reason() is None:
        assert served_model.quantization == "gguf-vnni"
    assert served_model.plan.executor.value == "native-stack"


def test_a_layer_whose_branch_does_more_than_the_multiplier_is_refused(default_model: Any) -> None:
    """The plan gives a family whose layers do more to a sub-layer's output than the stack's residual
    multiplier no native stack, and says why."""
    from tokenmill_service.contract.plan import LoadOptions
    from tokenmill_service.worker.device import probe_device
    from tokenmill_service.worker.kernels import ops_class
    from tokenmill_service.worker.plan.executor import ForwardInputs, native_stack_missing

    spec = family_spec(default_model.config.architecture)

    class Doubled(spec.module.layer_type):  # type: ignore[name-defined,misc]
        def branch(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * x

    class DoubledModule(spec.module):  # type: ignore[name-defined,misc]
        layer_type = Doubled

    doubled = dataclasses.replace(spec, module=DoubledModule)

    facts, native = probe_device("cpu"), ops_class("native")
    inputs = ForwardInputs(
        LoadOptions(), facts, native, torch.float32, default_model.plan.layers, spec, default_model.config
    )
    if native_stack_missing(inputs) is not None:
        pytest.skip("no native stack here")
    why = native_stack_missing(dataclasses.replace(inputs, family=doubled))
    assert why is not None and "residual multiplier" in why


@torch.inference_mode()
def test_dense_float32_layers_run_it_too(default_model: Any) -> None:
    # --quantization none: float32 rows through the block product's F32 format.
    same_bits(default_model)


def test_layers_without_a_native_kernel_and_compiled_regions_keep_the_python_forward(
    default_model_path: Path, compiled_model: Any
) -> None:
    from tokenmill_service.worker.loader import load_model

    # --quantization int8: torch's per-channel kernel, which native code cannot call.
    with capture_logs() as logs:
        model = load_model(default_model_path, quantization="int8")
    skipped = next(e for e in logs if e["event"] == "native_stack_skipped")
    assert "no native kernel" in skipped["reason"]
    assert model.plan.executor.value == "eager"
    # Compiled regions replace the stack.
    assert compiled_model.plan.executor.value == "compiled"


@torch.inference_mode()
def test_the_default_path_builds_no_attention_groups_nor_their_masks(served_model: Any) -> None:
    """The native kernels read the flat per-token view: the padded grids and their causal masks
    (quadratic in a long prompt) are never built."""
    from tokenmill_service.worker.engine.executor import make_executor
    from tokenmill_service.worker.engine.model_runner import allocate_kv_cache
    from tokenmill_service.worker.kernels.attention_metadata import build_attention_metadata

    k_cache, v_cache = allocate_kv_cache(served_model, 40, 16)
    meta = build_attention_metadata([300, 1], [280, 7], [list(range(37)), [37]], k_cache, v_cache)
    make_executor(served_model).forward(torch.zeros(301, dtype=torch.long), meta.positions, meta)
    assert meta._groups is None
    assert len(meta.groups) == 2  # built on demand for the kernels that use them


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Four layers (windowed, full, windowed, full): two KV-cache groups of two layers each."""
    pytest.importorskip("transformers")
    from tests.engine.gpt_oss_checkpoint import hf_gpt_oss
    from tokenmill_service.worker.loader import load_model

    directory = tmp_path_factory.mktemp("tiny-gpt-oss-stack")
    hf_gpt_oss(layers=4).save_pretrained(directory, safe_serialization=True)
    return load_model(directory, dtype=torch.float32, quantization="none")


@torch.inference_mode()
def test_gpt_oss_runs_the_native_stack_with_the_python_forwards_bits(gpt_oss: Any) -> None:
    """Sinks, windows of 8 keys (the steps' contexts reach 67), biases, YaRN, its routing, in one call."""
    assert gpt_oss.plan.executor.value == "native-stack", gpt_oss.plan.executor
    assert gpt_oss.attention_windows() == [8, None, 8, None]
    spec = build_decoder_stack(gpt_oss).spec  # every part of the layers described to the stack
    assert [ly.window for ly in spec.layers] == [8, None, 8, None]
    assert all(ly.sinks is not None and ly.qkv.bias is not None and ly.o.bias is not None for ly in spec.layers)
    assert all(ly.moe is not None and ly.moe.routing == "top_logits" and ly.moe.router.bias is not None
               for ly in spec.layers)  # fmt: skip
    same_bits(gpt_oss)


@torch.inference_mode()
def test_gpt_oss_windowed_and_global_layers_read_their_own_block_tables(gpt_oss: Any) -> None:
    """Two KV-cache groups ({0, 2} windowed, {1, 3} global), each layer its group's tables (the windowed
    ones with freed blocks) and its storage tensor: the eager loop's bits, and those of one group."""
    groups = plan_kv_cache_groups(gpt_oss.attention_windows())
    assert groups.layers == ((0, 2), (1, 3))
    grouped = same_bits(gpt_oss, groups)
    for a, b in zip(grouped, _run(gpt_oss, True)):
        assert torch.equal(a, b), (a - b).abs().max().item()


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def gemma_and_hf(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    """Gemma 2's two layers (windowed, global; head_dim 64) or Gemma 3's six (five windowed, one global;
    head_dim 256, Gemma 3 1B's), loaded, and the transformers model saved (the test's to change)."""
    pytest.importorskip("transformers")
    from tests.engine import gemma_checkpoints
    from tokenmill_service.worker.loader import load_model

    directory = tmp_path_factory.mktemp(f"tiny-{request.param}-stack")
    hf = gemma_checkpoints.gemma2() if request.param == "gemma2" else gemma_checkpoints.gemma3(head_dim=256)
    hf.save_pretrained(directory, safe_serialization=True)
    return load_model(directory, dtype=torch.float32, quantization="none"), hf


@torch.inference_mode()
def test_gemma_runs_the_native_stack_with_the_python_forwards_bits(gemma_and_hf: tuple[Any, Any]) -> None:
    """Windows of 8 keys (the steps' contexts reach 67), GeGLU, the sandwich norms, soft caps, Gemma 3's
    q/k norms and two rotary tables, in one call, each layer reading its KV-cache group (as the engine
    runs Gemma: its windowed layers' blocks behind the window freed); and Gemma 3's logits over a prompt
    of five windows are transformers' (heads of 256 in the native attention kernel)."""
    from tests.engine.gemma_checkpoints import PROMPT
    from tokenmill_service.worker.engine.model_runner import forward_prompt

    gemma, hf = gemma_and_hf
    assert gemma.plan.executor.value == "native-stack", gemma.plan.executor
    spec = build_decoder_stack(gemma).spec
    assert spec.activation == "gelu_tanh"
    assert all(ly.attn_out_norm is not None and ly.mlp_out_norm is not None for ly in spec.layers)
    windows = gemma.attention_windows()
    assert [ly.window for ly in spec.layers] == windows and windows[0] == 8 and windows[-1] is None
    if gemma.config.architecture == "gemma2":
        assert spec.qk_norm == "none" and [ly.softcap for ly in spec.layers] == [10.0, 10.0]
    else:  # the global layer rotates with its own tables, the local ones with the stack's
        assert spec.head_dim == 256 and spec.qk_norm == "heads"
        assert [ly.cos is not None for ly in spec.layers] == [False] * 5 + [True]
        assert not torch.equal(spec.layers[5].cos, spec.cos)
    groups = plan_kv_cache_groups(windows)
    assert groups.num_groups > 1
    same_bits(gemma, groups)
    if spec.head_dim == 256:  # (tests/engine/test_gemma*.py hold heads of 64 to transformers)
        # transformers in float64 (its float32 logits are 1.6e-4 from those here: wider heads, longer sums).
        expected = hf.double()(torch.tensor([PROMPT])).logits[0]
        actual = gemma.compute_logits(forward_prompt(gemma, PROMPT)).double()
        torch.testing.assert_close(actual, expected, atol=2e-4, rtol=0)


@pytest.fixture(scope="module", params=["granite", "phi3-partial", "phi3-partial-longrope"])
def llama_variant(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Granite (its four multipliers away from 1) or Phi-3 with partial rotary (32 of 64 dims; with
    LongRoPE, its long factors chosen for the model's 256-position context), loaded."""
    pytest.importorskip("transformers")
    from tests.engine.granite_phi3_checkpoints import granite, phi3
    from tokenmill_service.worker.loader import load_model

    directory = tmp_path_factory.mktemp(f"tiny-{request.param}-stack")
    if request.param == "granite":
        hf = granite(tied=False)
    else:
        hf = phi3("tied-partial" if request.param == "phi3-partial" else "untied-partial-longrope")
    hf.save_pretrained(directory, safe_serialization=True)
    return load_model(directory, dtype=torch.float32, quantization="none")


@torch.inference_mode()
def test_granite_and_phi3_run_the_native_stack_with_the_python_forwards_bits(llama_variant: Any) -> None:
    """Granite's residual multiplier (the eager layer's one float32 product on each sub-layer's output)
    and Phi-3's partial rotary (the first 32 dims of each 64-dim head turned, the rest passed through;
    LongRoPE's one table for every step), in one call: the eager loop's hidden states over a prompt and
    its logits over mixed prefill, decode and crowded steps, bit for bit."""
    from tests.engine.granite_phi3_checkpoints import PROMPT
    from tokenmill_service.worker.engine.model_runner import forward_prompt

    model = llama_variant
    spec = build_decoder_stack(model).spec
    if model.config.architecture == "granite":
        assert spec.residual_multiplier == 0.22 and spec.rotary_dim == spec.head_dim
    else:
        assert spec.residual_multiplier == 1.0 and (spec.rotary_dim, spec.head_dim) == (32, 64)
    eager = forward_prompt(model, PROMPT, executor="eager")
    assert torch.equal(forward_prompt(model, PROMPT, executor="native-stack"), eager)
    same_bits(model)


@pytest.fixture(scope="module", params=["q_lora", "no_q_lora"])
def deepseek(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """DeepSeek-V3's three layers (the first dense; then 8 routed experts in 2 groups, 1 group kept, 2 a token,
    1 shared expert): with the low-rank query path, YaRN and interleaved rotary dims, or q_proj and plain ones."""
    pytest.importorskip("transformers")
    from tests.tiny_deepseek import deepseek_v3
    from tokenmill_service.worker.loader import load_model

    directory = tmp_path_factory.mktemp(f"tiny-deepseek-{request.param}-stack")
    deepseek_v3(q_lora=request.param == "q_lora", moe=True).save_pretrained(directory, safe_serialization=True)
    with capture_logs() as logs:
        model = load_model(directory, dtype=torch.float32, quantization="none")
    loaded = next(e for e in logs if e["event"] == "model_loaded")
    assert loaded["layers"] == "native stack"
    return model


@torch.inference_mode()
def test_deepseek_v3_runs_the_native_stack_with_the_python_forwards_bits(deepseek: Any) -> None:
    """Latent attention (the query's low-rank path or q_proj, the normed latent, DeepSeek's interleaved YaRN
    rotary or plain halves, the absorbed products over the latent cache), grouped sigmoid routing with its
    correction bias, the shared experts and the dense first layer, in one call: the eager loop's hidden
    states over a prompt and its logits over mixed prefill, decode and crowded steps, bit for bit; a
    prompt alone and in a crowd, and prefilled or decoded, the same bits on the stack."""
    from tests.engine.invariance import assert_alone_equals_crowd, assert_prefill_equals_decode
    from tokenmill_service.worker.engine.model_runner import forward_prompt

    model = deepseek
    spec = build_decoder_stack(model).spec
    assert spec.latent is not None and spec.latent.interleave == (model.config.extra["mla"].q_lora_rank > 0)
    assert [ly.latent is not None and (ly.latent.q_a is not None) == spec.latent.interleave
            for ly in spec.layers] == [True] * 3  # fmt: skip
    assert spec.layers[0].moe is None and spec.layers[0].gate_up is not None  # dense
    for ly in spec.layers[1:]:  # routed by groups, plus the shared experts
        assert ly.moe is not None and ly.moe.routing == "grouped_renormalized" and ly.gate_up is not None
    prompt = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    eager = forward_prompt(model, prompt, executor="eager")
    assert torch.equal(forward_prompt(model, prompt, executor="native-stack"), eager)
    same_bits(model)
    assert_alone_equals_crowd(model, prompt)
    assert_prefill_equals_decode(model, prompt[:20], 12)
