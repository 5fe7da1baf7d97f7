"""What every model family's engine tests do with a tiny transformers checkpoint: load it on one ops
backend at float32 (dense), compare its logits and prompt logprobs with transformers' forward pass,
decode greedily through the paged KV cache, and run it on tensor-parallel ranks (gloo on CPU, real
processes). The families' own modules keep what is theirs (configs, guards, GGUF keys)."""

from __future__ import annotations

import dataclasses
import socket
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tests.rank_processes import run_ranks
from tests.triton_setup import DEVICE  # before anything imports triton: its interpreter without a GPU
from tokenmill_service.contract.plan import LoadOptions
from tokenmill_service.worker.device import probe_device
from tokenmill_service.worker.distributed.parallel import TensorParallel
from tokenmill_service.worker.engine.model_runner import ModelRunner, StepPlan, forward_prompt
from tokenmill_service.worker.loader import load_model
from tokenmill_service.worker.models.builder import build_model
from tokenmill_service.worker.models.checkpoint import open_checkpoint
from tokenmill_service.worker.plan.resolve import resolve_plan

ATOL = 1e-4  # float32, dense: transformers' float32 forward pass within this


def load(directory: Path, ops: str) -> Any:
    """The checkpoint at float32, dense, on the ``ops`` backend: ``native`` (as served on a CPU),
    ``torch`` (the reference ops, as a machine without tokenmill's native attention kernel gets them)
    or ``triton`` (its interpreter without a GPU)."""
    if ops == "native":
        model = load_model(directory, dtype=torch.float32, quantization="none")
    elif ops == "triton":
        model = load_model(directory, dtype=torch.float32, quantization="none", backend="triton", device=DEVICE.type)
    else:
        facts = probe_device("cpu")
        facts = dataclasses.replace(facts, native_missing={**facts.native_missing, "paged_attention": "not asked"})
        checkpoint = open_checkpoint(directory)
        options = LoadOptions(model=str(directory), dtype="float32", quantization="none")
        model = build_model(resolve_plan(options, checkpoint, facts), checkpoint)
    assert model.plan.ops.value == ops
    return model


def hf_logits(hf_model: Any, ids: list[int]) -> torch.Tensor:
    """transformers' float32 logits of every position of ``ids``."""
    with torch.inference_mode():
        return hf_model(torch.tensor([ids])).logits[0]


@torch.inference_mode()
def assert_prompt_matches(model: Any, hf_model: Any, prompt: list[int]) -> None:
    """The model's logits and prompt logprobs over ``prompt`` within ``ATOL`` of transformers'."""
    actual = model.compute_logits(forward_prompt(model, prompt)).cpu()
    expected = hf_logits(hf_model, prompt)
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(torch.log_softmax(actual, -1), torch.log_softmax(expected, -1), atol=ATOL, rtol=0)


def greedy(model: Any, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy tokens through the runner's paged KV cache: a prefill, then one decode step per token."""
    runner = ModelRunner(model, block_size=16, num_blocks=8)
    ids, start, table = list(prompt), 0, list(range(8))
    for _ in range(new_tokens):
        new = ids[start:]
        logits, _ = runner.execute(StepPlan(new, [len(new)], [start], [table], [len(new) - 1], []))
        start = len(ids)
        ids.append(int(logits[0].argmax()))
    return ids[len(prompt) :]


def hf_greedy(hf_model: Any, prompt: list[int], new_tokens: int) -> list[int]:
    """transformers' own greedy choice, one full forward pass per token."""
    ids = list(prompt)
    for _ in range(new_tokens):
        ids.append(int(hf_logits(hf_model, ids)[-1].argmax()))
    return ids[len(prompt) :]


def assert_greedy_matches(model: Any, hf_model: Any, prompt: list[int], new_tokens: int) -> None:
    assert greedy(model, prompt, new_tokens) == hf_greedy(hf_model, prompt, new_tokens)


# -- tensor parallel ----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_logits(rank: int, size: int, port: int, path: str, out: str, prompt: list[int], float32: bool) -> None:
    """One rank: join the group, load this rank's part, write the gathered logits and its first layer's
    head count and q-norm shape (rank 0)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    try:
        dense = {"dtype": torch.float32, "quantization": "none"} if float32 else {}
        model = load_model(Path(path), tp=TensorParallel(rank, size), **dense)
        attn = model.model.layers[0].self_attn
        with torch.inference_mode():
            logits = model.compute_logits(forward_prompt(model, prompt))
        if rank == 0:
            q_norm = getattr(attn, "q_norm", None)
            shape = None if q_norm is None else tuple(q_norm.weight.shape)
            torch.save({"logits": logits, "heads": attn.num_heads, "q_norm": shape}, out)
    finally:
        dist.destroy_process_group()


def tensor_parallel_logits(directory: Path, prompt: list[int], tmp_path: Path, float32: bool = False) -> dict[str, Any]:
    """Two ranks' logits over ``prompt`` (``float32``: dense float32, else the defaults), with rank 0's
    first-layer ``heads`` and ``q_norm`` shape (None without one)."""
    out = tmp_path / "logits.pt"
    run_ranks(_rank_logits, (2, free_port(), str(directory), str(out), prompt, float32), 2)
    result: dict[str, Any] = torch.load(out)
    return result


@torch.inference_mode()
def whole_model_logits(directory: Path, prompt: list[int]) -> torch.Tensor:
    """One rank's logits over ``prompt`` in the default configuration, to compare the ranks' with."""
    model = load_model(directory)
    return model.compute_logits(forward_prompt(model, prompt))


@torch.inference_mode()
def assert_default_within_bounds(directory: Path, hf_model: Any, prompt: list[int]) -> None:
    """The checkpoint in the server's default configuration (dtype, quantization, backend, executor):
    prompt logprobs within the default's fidelity bounds of transformers' float32 ones (mean 1e-3, max 1e-2)."""
    from tokenmill_service.worker.engine.executor import make_executor

    model = load_model(directory)
    got = torch.log_softmax(make_executor(model).compute_logits(forward_prompt(model, prompt)).double(), -1)
    want = torch.log_softmax(hf_logits(hf_model, prompt).double(), -1)
    targets = torch.tensor(prompt[1:])[:, None]
    error = (got[:-1].gather(1, targets) - want[:-1].gather(1, targets)).abs()
    assert error.mean() < 1e-3 and error.max() < 1e-2, (error.mean().item(), error.max().item())
