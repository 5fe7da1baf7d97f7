"""The load plan: one place decides what runs, with a reason for each choice.

``resolve_plan`` is given the device's facts, so each refusal can be asked for on any machine (no
compiler, no AVX-512 VNNI, tensor parallel with the native stack, triton without a GPU); a toy
quantization method and a toy ops backend, one file each (tests/plugins/), are chosen by name; the
running default server logs its plan, reports it in GetModelInfo, and never maps libtorch.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from tests.plugins import toy_backend, toy_quantization
from tests.server_process import ServerProcess
from tokenmill_client._proto import generate_pb2 as pb
from tokenmill_client._proto import generate_pb2_grpc as pb_grpc
from tokenmill_service.contract.config import load_settings
from tokenmill_service.contract.plan import LoadOptions, LoadPlan, PlanRefused
from tokenmill_service.front.router.spec import worker_spec
from tokenmill_service.worker.device import NATIVE_KERNELS, DeviceFacts, probe_device
from tokenmill_service.worker.engine.model_runner import forward_prompt
from tokenmill_service.worker.loader import load_model
from tokenmill_service.worker.models.checkpoint import Checkpoint, open_checkpoint
from tokenmill_service.worker.plan.resolve import resolve_plan

NO_COMPILER = "no C++ compiler (g++) on PATH"
NO_VNNI = "the CPU has no AVX-512 VNNI"


@pytest.fixture(scope="module")
def smollm(default_model_path: Path) -> Checkpoint:
    return open_checkpoint(default_model_path)  # the tensors are never read here


def plan(checkpoint: Checkpoint, facts: DeviceFacts | None = None, **options: Any) -> LoadPlan:
    return resolve_plan(LoadOptions(**options), checkpoint, facts or DeviceFacts())


def test_every_choice_of_the_default_plan_says_why(smollm: Checkpoint) -> None:
    p = resolve_plan(LoadOptions(), smollm, probe_device("cpu"))
    assert (p.act_dtype.value, p.ops.value, p.executor.value) == ("float32", "native", "native-stack")
    assert p.kv_cache_layout == "blocks, keys transposed per block"
    assert set(p.method_counts) == {"gguf-vnni"} and sum(p.method_counts.values()) == 30 * 4 + 1
    for decision in (p.act_dtype, p.ops, p.kv_cache_dtype, p.executor):
        assert decision.reason
    summary = p.summary()
    assert summary["executor"].startswith("native-stack (") and summary["quantization.gguf-vnni"]


def test_the_served_context_travels_to_the_plan(smollm: Checkpoint) -> None:
    """--max-model-len reaches each worker's load options (a family whose rotary depends on the served
    context, LongRoPE, chooses by it: tests/engine/test_phi3.py); Llama's rotary does not, no ``rope``."""
    spec = worker_spec(load_settings(["--max-model-len", "64"], environ={}), 1, 0, 0, 0)
    assert spec.options.max_model_len == spec.engine.max_model_len == 64
    assert LoadOptions.from_settings(load_settings([], environ={})).max_model_len == 0  # the model's own
    p = plan(smollm, max_model_len=64)
    assert p.rope is None and "rope" not in p.summary()


def test_without_a_compiler_auto_serves_torchs_kernels_and_says_why(smollm: Checkpoint) -> None:
    facts = DeviceFacts(native_missing=dict.fromkeys(NATIVE_KERNELS, NO_COMPILER))
    p = plan(smollm, facts)
    assert p.skipped["gguf-vnni"] == p.skipped["gguf"] == NO_COMPILER
    # Every layer dense float32, exactly dequantized (the Q4_1 layers too: not torch's int4 kernel, which
    # rounds to bfloat16), by torch's sliced product; the embedding table kept as the file stores it.
    assert p.method_counts == {"none": 121} and p.act_dtype.value == "float32"
    assert {c.kernel for c in p.layers.values()} == {"sliced-matmul"} and p.embed_dtype == "gguf-blocks"
    why = p.quant_reasons["none"]
    assert why.startswith("Q4_1 tensors, dense (exactly dequantized): no native kernel serves here")
    assert "torch's int4 kernel rounds to bfloat16, outside the default's fidelity bounds" in why
    assert "--quantization int4" in why and "Q8_0 tensors, dense (exactly dequantized)" in why
    assert p.ops.value == "torch" and NO_COMPILER in p.ops.reason
    assert p.executor.value == "eager" and "not tokenmill's native kernel" in p.executor.reason
    with pytest.raises(
        PlanRefused, match=re.escape(f"--quantization gguf needs tokenmill's native CPU kernel: {NO_COMPILER}")
    ):
        plan(smollm, facts, quantization="gguf")
    with pytest.raises(PlanRefused, match="float16 needs tokenmill's native attention kernel: no C\\+\\+ compiler"):
        plan(smollm, facts, kv_cache_dtype="float16")


def test_with_the_native_kernels_turned_off_auto_stays_faithful_and_int4_is_asked_for(smollm: Checkpoint) -> None:
    """TOKENMILL_NATIVE_KERNELS=0 plans as a missing compiler does; torch's int4 kernel serves only when
    asked (--quantization int4), or on a GPU, where the native kernels never run."""
    off = DeviceFacts(native_missing=dict.fromkeys(NATIVE_KERNELS, "TOKENMILL_NATIVE_KERNELS=0"))
    p = plan(smollm, off)
    assert p.method_counts == {"none": 121} and p.skipped["native-ops"] == "TOKENMILL_NATIVE_KERNELS=0"
    assert p.executor.value == "eager"
    asked = plan(smollm, off, quantization="int4")
    assert asked.method_counts == {"int4": 120, "int8": 1} and asked.quant_reasons["int4"] == "asked (--quantization)"
    gpu = plan(smollm, DeviceFacts(device="cuda:0"))
    assert gpu.method_counts == {"int4": 120, "none": 1}
    assert gpu.quant_reasons["int4"] == "Q4_0/Q4_1 blocks kept as int4 exactly as stored (no native kernel serves here)"


def test_without_vnni_auto_takes_the_float32_block_kernel_and_says_why(smollm: Checkpoint) -> None:
    facts = DeviceFacts(native_missing={"vnni_gemm": NO_VNNI})
    p = plan(smollm, facts)
    assert p.skipped == {"gguf-vnni": NO_VNNI}
    assert p.method_counts == {"gguf": 121} and p.executor.value == "native-stack"
    with pytest.raises(PlanRefused, match=f"gguf-vnni needs tokenmill's native CPU kernel: {NO_VNNI}"):
        plan(smollm, facts, quantization="gguf-vnni")


def test_tensor_parallel_ranks_run_without_the_native_stack_and_say_why(smollm: Checkpoint) -> None:
    p = plan(smollm, tensor_parallel=3)
    assert p.executor.value == "eager" and "all-reduce between the layers" in p.executor.reason
    with pytest.raises(PlanRefused, match="9 query heads"):
        plan(smollm, tensor_parallel=2)


def test_triton_without_a_gpu_is_refused_with_the_way_out(smollm: Checkpoint) -> None:
    facts = DeviceFacts(triton_missing="--backend triton needs a GPU (--device cuda) and --device is cpu: use ...")
    with pytest.raises(PlanRefused, match="--backend triton cannot run here: --backend triton needs a GPU"):
        plan(smollm, facts, backend="triton")
    interpreted = plan(smollm, DeviceFacts(triton_interpreter=True), backend="triton", dtype="bfloat16")
    assert interpreted.act_dtype.value == "float32" and "interpreter" in interpreted.act_dtype.reason
    assert interpreted.ops.value == "triton" and interpreted.executor.value == "eager"


def test_compiling_replaces_the_stack_and_where_it_cannot_says_why(smollm: Checkpoint) -> None:
    assert plan(smollm, compile="auto").executor.value == "compiled"
    p = plan(smollm, DeviceFacts(compiler_missing="no C++ compiler for inductor"), compile="auto")
    assert p.executor.value == "native-stack" and p.skipped["compile"] == "no C++ compiler for inductor"


def test_dense_and_bfloat16_choices(smollm: Checkpoint) -> None:
    dense = plan(smollm, quantization="none", dtype="float32")
    assert {c.kernel for c in dense.layers.values()} == {"block_gemm-f32"} and dense.executor.value == "native-stack"
    sliced = plan(smollm, DeviceFacts(native_missing={"block_gemm": NO_COMPILER}), quantization="none")
    assert {c.kernel for c in sliced.layers.values()} == {"sliced-matmul"}
    bf16 = plan(smollm, DeviceFacts(native_bf16=True), quantization="none")
    assert bf16.act_dtype.value == "bfloat16" and bf16.ops.value == "torch"
    with pytest.raises(PlanRefused, match="needs float32 activations"):
        plan(smollm, dtype="bfloat16", kv_cache_dtype="float32")
    assert plan(smollm, quantization="int4").layers["lm_head"].method == "int8"


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    )
    path = tmp_path_factory.mktemp("tiny")
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    return path


@torch.inference_mode()
def test_a_toy_method_and_a_toy_backend_are_one_file_each(tiny_checkpoint: Path) -> None:
    toy_backend.CALLS["attention"] = 0
    toy = load_model(tiny_checkpoint, quantization="toy-pow2", backend="toy-transposed")
    assert toy.plan.quant_method("model.layers.1.mlp.down_proj").method == "toy-pow2"
    assert toy.plan.ops.value == "toy-transposed" and toy.plan.kv_cache_layout.startswith("toy")
    assert toy.quantization == "toy-pow2" and isinstance(toy.lm_head.quant, toy_quantization.Pow2RowsMethod)
    reference = load_model(tiny_checkpoint, backend="torch")
    ids = [1, 5, 9, 3, 60, 2]
    assert torch.allclose(forward_prompt(toy, ids), forward_prompt(reference, ids), atol=1e-5)
    assert toy_backend.CALLS["attention"] == 2
    with pytest.raises(PlanRefused, match="toy-pow2 cannot run here: it multiplies float32"):
        load_model(tiny_checkpoint, quantization="toy-pow2", dtype=torch.bfloat16)


# -- the running default server ---------------------------------------------------------------


def test_the_default_server_logs_and_reports_its_plan(server: ServerProcess) -> None:
    loaded = [json.loads(line) for line in server.logs().splitlines() if '"model_loaded"' in line]
    assert loaded and loaded[0]["plan"]["executor"].startswith("native-stack")
    with grpc.insecure_channel(server.address) as channel:
        info = pb_grpc.GenerationStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert dict(info.load_plan) == loaded[0]["plan"]
    assert info.load_plan["ops"].startswith("native (") and info.load_plan["kv_cache_layout"]
    # No sliding windows: a sequence may hold a full context's blocks.
    assert info.kv_cache_per_sequence.endswith(
        f"tokens' blocks at most (a full context of {info.context_length} tokens)"
    )


def test_the_server_process_never_maps_libtorch(server: ServerProcess) -> None:
    """Checked on the running process's memory maps, not by importing modules: its workers map
    libtorch, the server (router, gRPC, HTTP) does not."""
    assert server.proc is not None
    maps = Path(f"/proc/{server.proc.pid}/maps").read_text()
    assert "libtorch" not in maps and "libc10" not in maps
    workers = [p for p in Path(f"/proc/{server.proc.pid}/task").glob("*/children")]
    children = {int(pid) for f in workers for pid in f.read_text().split()}
    assert any("libtorch" in Path(f"/proc/{pid}/maps").read_text() for pid in children)
