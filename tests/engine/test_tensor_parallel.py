"""Tensor-parallel shards (gloo on CPU, real processes) give the logits of the whole model.

Each test writes a tiny random Hugging Face checkpoint, loads it whole in this process and
sharded over N ranks (processes), and compares the gathered logits. The checkpoint has 4 query
heads and 2 key/value heads, so degree 4 replicates each key/value head on two ranks.
"""

from __future__ import annotations

import socket
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.rank_processes import run_ranks
from tokenmill_service.contract.parallel_degree import ModelDims, check_degree, working_degrees
from tokenmill_service.worker.distributed.parallel import TensorParallel
from tokenmill_service.worker.engine.model_runner import forward_prompt
from tokenmill_service.worker.loader import load_model, resolve_model_path

transformers = pytest.importorskip("transformers")

TINY = dict(  # noqa: C408 - keyword names as in the transformers config
    vocab_size=128,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
PROMPT = [3, 17, 99, 42, 5, 64, 127, 0, 8, 33, 71, 12, 90, 101, 2, 58, 77, 19, 46, 120]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator) * 0.1
            param.copy_(noise + 1.0 if "norm" in name else noise * 2)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_logits(rank: int, size: int, port: int, path: str, quantizations: list[str], out: str) -> None:
    """One rank: join the group, load this rank's shard, write the gathered logits (rank 0)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    try:
        logits = {}
        for quantization in quantizations:
            model = load_model(Path(path), quantization=quantization, tp=TensorParallel(rank, size))
            logits[quantization] = model.compute_logits(forward_prompt(model, PROMPT))
        if rank == 0:
            torch.save(logits, out)
    finally:
        dist.destroy_process_group()


# Each degree's ranks are started once for every quantization (each rank loads the checkpoint).
QUANTIZATIONS = {2: ["none", "int4"], 4: ["none"]}


@pytest.fixture(scope="module")
def sharded(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, torch.Tensor]]:
    results = {}
    for size, quantizations in QUANTIZATIONS.items():
        out = tmp_path_factory.mktemp("logits") / f"{size}.pt"
        run_ranks(_rank_logits, (size, _free_port(), str(checkpoint), quantizations, str(out)), size)
        results[size] = torch.load(out)
    return results


def _whole_logits(checkpoint: Path, quantization: str) -> torch.Tensor:
    model = load_model(checkpoint, quantization=quantization)
    return model.compute_logits(forward_prompt(model, PROMPT))


@pytest.mark.parametrize("size", [2, 4])
def test_sharded_model_gives_the_whole_models_logits(
    checkpoint: Path, sharded: dict[int, dict[str, torch.Tensor]], size: int
) -> None:
    torch.testing.assert_close(sharded[size]["none"], _whole_logits(checkpoint, "none"), atol=1e-4, rtol=0)


def test_int4_shards_quantize_the_same_groups(checkpoint: Path, sharded: dict[int, dict[str, torch.Tensor]]) -> None:
    # Row-parallel shards cut the input at multiples of 32, so each rank holds whole groups of the
    # same int4 weights. The kernel returns bfloat16 partial sums, rounded per rank before the
    # all-reduce, so the shards differ from the whole by that rounding: far less than int4 itself.
    dense = torch.log_softmax(_whole_logits(checkpoint, "none"), dim=-1)
    whole = torch.log_softmax(_whole_logits(checkpoint, "int4"), dim=-1)
    shards = torch.log_softmax(sharded[2]["int4"], dim=-1)
    sharding_error = (shards - whole).abs().mean().item()
    quantization_error = (whole - dense).abs().mean().item()
    assert sharding_error < quantization_error / 4, (sharding_error, quantization_error)


def _rank_prompt_logprobs(rank: int, size: int, port: int, prompts: list[list[int]], out: str) -> None:
    """One rank of the embedded model in its default configuration (the GGUF's blocks as stored, float32)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    try:
        model = load_model(resolve_model_path(None), quantization="auto", tp=TensorParallel(rank, size))
        logprobs = [torch.log_softmax(model.compute_logits(forward_prompt(model, ids)), dim=-1) for ids in prompts]
        if rank == 0:
            torch.save(logprobs, out)
    finally:
        dist.destroy_process_group()


def test_the_quantized_default_on_three_ranks_stays_within_the_fidelity_bound(
    reference: dict[str, Any], tmp_path: Path
) -> None:
    cases = reference["prompt_logprobs"]
    out = tmp_path / "logprobs.pt"
    run_ranks(_rank_prompt_logprobs, (3, _free_port(), [c["ids"] for c in cases], str(out)), 3)
    errors = []
    for case, logprobs in zip(cases, torch.load(out)):
        # Row r predicts token r + 1 of the prompt.
        for r, ref in enumerate(case["positions"]):
            errors.append(abs(logprobs[r, ref["token"]].item() - ref["logprob"]))
    assert sum(errors) / len(errors) <= 0.03  # the seams issue's bound for the quantized default


SMOLLM2 = ModelDims(num_heads=9, num_kv_heads=3, head_dim=64, intermediate_size=1536, vocab_size=49152)


def test_degrees_that_split_smollm2() -> None:
    assert working_degrees(SMOLLM2, int4_groups=True) == [1, 3]
    check_degree(SMOLLM2, 3, int4_groups=True)
    with pytest.raises(ValueError, match=r"9 query heads, 3 key/value heads.*degrees that work: 1, 3"):
        check_degree(SMOLLM2, 2, int4_groups=True)


def test_quantized_row_parallel_inputs_stay_multiples_of_32() -> None:
    dims = ModelDims(num_heads=8, num_kv_heads=8, head_dim=16, intermediate_size=256, vocab_size=256)
    # 8 heads x 16 / 8 ranks = 16 input features of o_proj per rank: fine dense, not in int4 groups.
    assert 8 in working_degrees(dims, int4_groups=False)
    assert working_degrees(dims, int4_groups=True) == [1, 2, 4]
    with pytest.raises(ValueError, match="multiples of 32"):
        check_degree(dims, 8, int4_groups=True)


def test_k_quant_row_parallel_inputs_stay_whole_super_blocks() -> None:
    # Llama 2 7B: 11008 = 43 x 256 MLP inputs split in 32-weight blocks, never in 256-weight super-blocks.
    llama2 = ModelDims(num_heads=32, num_kv_heads=32, head_dim=128, intermediate_size=11008, vocab_size=32000)
    assert working_degrees(replace(llama2, block=32, block_format="Q8_0")) == [1, 2, 4, 8]
    q4_k = replace(llama2, block=256, block_format="Q4_K")
    assert working_degrees(q4_k) == [1]
    with pytest.raises(ValueError, match=r"multiples of 256 .*one of the checkpoint's Q4_K blocks of 256 weights"):
        check_degree(q4_k, 2)
