"""The triton LoRA kernels (grouped by adapter) give the per-token definition, a row's bits whatever group
it is in, and under ``--backend triton`` a model's adapter gives transformers + PEFT's logprobs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.triton_setup import DEVICE
from tokenmill_service.worker.kernels import LoRAStack
from tokenmill_service.worker.kernels.triton.lora import BLOCK_M, lora_delta
from tokenmill_service.worker.layers.lora.sgmv import lora_delta_reference


def grouped(token_slots: list[int]) -> list[tuple[int, torch.Tensor]]:
    return [
        (s, torch.tensor([t for t, x in enumerate(token_slots) if x == s], device=DEVICE))
        for s in sorted(set(token_slots) - {-1})
    ]


# Tails in K, N and the row tiles; (5, 64, 192) as a packed layer: three blocks of A, each its rows of B.
@pytest.mark.parametrize(
    ("tokens", "k", "n", "parts"), [(37, 100, 96, None), (5, 64, 192, [(0, 64), (64, 100), (164, 28)])]
)
def test_the_grouped_kernels_are_the_per_token_definition(
    tokens: int, k: int, n: int, parts: list[tuple[int, int]] | None
) -> None:
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, k, generator=g)
    p = len(parts or [0])
    rank = 96 // p
    a, bt = torch.randn(4, p, rank, k, generator=g) * 0.1, torch.randn(4, rank, n, generator=g) * 0.1
    # Each slot's rank per block (one block not targeted): the rows past it hold garbage and are not read.
    ranks = torch.tensor([[rank, 3, 0], [7, rank, 1], [1, 0, rank], [rank - 1, rank, 5]])[:, :p].contiguous()
    token_slots = torch.randint(-1, 4, (tokens,), generator=g).tolist()
    token_slots[: BLOCK_M + 2] = [2] * min(tokens, BLOCK_M + 2)  # a group of two tiles (when there are as many)
    delta = torch.zeros(tokens, n, dtype=torch.float64)
    groups = grouped(token_slots)
    stack = LoRAStack(a, bt, ranks, parts or [(0, n)])
    x_on, on = x.to(DEVICE), LoRAStack(a.to(DEVICE), bt.to(DEVICE), ranks.to(DEVICE), stack.parts)
    for rows, d in lora_delta(x_on, on, groups):
        delta[rows.cpu()] = d.cpu().double()
    expected = lora_delta_reference(x, stack, token_slots)
    torch.testing.assert_close(delta, expected, atol=1e-5, rtol=1e-5)
    # A row's bits are the same in a group of one.
    for slot, rows in groups:
        ((_, whole),) = lora_delta(x_on, on, [(slot, rows)])
        ((_, alone),) = lora_delta(x_on, on, [(slot, rows[-1:])])
        assert torch.equal(alone[0], whole[-1])


def test_a_model_on_the_triton_backend_serves_an_adapter_as_transformers_plus_peft(tmp_path: Path) -> None:
    from tests.lora_adapters import make_adapter, peft_model, tiny_llama
    from tokenmill_service.worker.engine.model_runner import ModelRunner, StepPlan
    from tokenmill_service.worker.kernels.triton import lora
    from tokenmill_service.worker.loader import load_model

    hf = tiny_llama(tmp_path / "base", num_hidden_layers=1)  # one layer: the interpreter is slow
    adapter = make_adapter(hf, tmp_path / "r8", 8, seed=10)
    model = load_model(tmp_path / "base", backend="triton", device=DEVICE.type, max_loras=1, max_lora_rank=8)
    assert all(slots.delta is lora.lora_delta for _, slots in model.lora.layers.values())
    model.lora.load(0, "r8", str(adapter))
    prompt = torch.randint(0, 96, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    n = len(prompt)
    runner = ModelRunner(model, block_size=16, num_blocks=4)
    _, (logits,) = runner.execute(StepPlan(prompt, [n], [0], [[0]], [n - 1], [(0, n)], adapter_slots=[0]))
    with torch.inference_mode():
        theirs = torch.log_softmax(peft_model(hf, adapter)(torch.tensor([prompt])).logits[0], -1)
    torch.testing.assert_close(torch.log_softmax(logits.cpu(), -1), theirs, atol=1e-4, rtol=0)
