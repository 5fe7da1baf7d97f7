"""Running through the paged KV cache gives, bit for bit, the logits of one full prefill.

Uses the embedded model in float32 unquantized, as served by default (the GGUF's blocks), and
compiled (``--compile auto``). Prompts are prefilled in chunks and then decoded a token at a
time, alone and side by side with another sequence, with block tables that are deliberately not
in order (and pad with block 0, which belongs to another sequence) so that slot arithmetic,
gathering and masking are all exercised.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tokenmill_service.worker.engine.executor import make_executor
from tokenmill_service.worker.engine.model_runner import allocate_kv_cache, forward_prompt
from tokenmill_service.worker.kernels.attention_metadata import build_attention_metadata
from tokenmill_service.worker.models.decoder import DecoderForCausalLM

REFERENCE = Path(__file__).parents[1] / "data" / "smollm2_reference.json"
BLOCK_SIZE = 4
NUM_BLOCKS = 16


class Cache:
    """A KV cache of our own for one of the session's models (conftest.py)."""

    def __init__(self, model: DecoderForCausalLM) -> None:
        self.k, self.v = allocate_kv_cache(model, NUM_BLOCKS, BLOCK_SIZE)


@pytest.fixture(params=["reference", "served", "compiled"])
def model(request: pytest.FixtureRequest) -> Iterator[DecoderForCausalLM]:
    """float32 unquantized; the server's default (the GGUF's blocks); the same with --compile auto."""
    yield request.getfixturevalue(
        {"reference": "default_model", "served": "served_model"}.get(request.param, "compiled_model")
    )


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    data = json.loads(REFERENCE.read_text())["prompt_logprobs"]
    return [p["ids"] for p in sorted(data, key=lambda p: -len(p["ids"]))]


def full_pass_logits(model: DecoderForCausalLM, ids: list[int]) -> torch.Tensor:
    """Logits of every position from one prefill of the whole sequence (its own cache, 16-token blocks)."""
    return model.compute_logits(forward_prompt(model, ids))


class Sequence:
    """One sequence's tokens and blocks, and how far it has been run."""

    def __init__(self, ids: list[int], blocks: list[int]) -> None:
        self.ids = ids
        self.blocks = blocks
        self.done = 0  # tokens already in the cache

    def slot(self, position: int) -> int:
        return self.blocks[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE


def run_step(model: DecoderForCausalLM, cache: Cache, steps: list[tuple[Sequence, int]]) -> list[torch.Tensor]:
    """Run the next ``n`` tokens of each sequence in one flat batch; the logits of each, in order."""
    ids: list[int] = []
    positions: list[int] = []
    for seq, n in steps:
        new = range(seq.done, seq.done + n)
        ids += [seq.ids[p] for p in new]
        positions += list(new)
    query_lens = [n for _, n in steps]
    meta = build_attention_metadata(
        query_lens, [seq.done for seq, _ in steps], [seq.blocks for seq, _ in steps], cache.k, cache.v
    )
    run = make_executor(model)  # as the model's plan runs it (native stack, compiled regions, ...)
    logits = run.compute_logits(run.forward(torch.tensor(ids), torch.tensor(positions), meta))
    for seq, n in steps:
        seq.done += n
    return list(logits.split(query_lens))


@torch.inference_mode()
def test_chunked_prefill_then_decode_matches_a_full_pass(model: DecoderForCausalLM, prompts: list[list[int]]) -> None:
    ids = prompts[0][:17]
    expected = full_pass_logits(model, ids)
    seq = Sequence(ids, blocks=[9, 3, 12, 5, 0])  # 17 tokens need 5 blocks of 4
    cache = Cache(model)
    got = run_step(model, cache, [(seq, 6)])  # first prefill chunk ends mid-block
    got += run_step(model, cache, [(seq, 7)])  # second chunk reads the first from the cache
    while seq.done < len(ids):
        got += run_step(model, cache, [(seq, 1)])  # decode, one token per step
    # Bit for bit: neither the chunking, the block size, nor prefill versus decode changes a result.
    assert torch.equal(torch.cat(got), expected)


@torch.inference_mode()
def test_two_sequences_batched_through_the_cache_match_their_full_passes(
    model: DecoderForCausalLM, prompts: list[list[int]]
) -> None:
    a_ids, b_ids = prompts[0][:14], prompts[1][:11]
    expected_a, expected_b = full_pass_logits(model, a_ids), full_pass_logits(model, b_ids)
    # b's table is shorter and padded with 0, a block that a is using.
    a = Sequence(a_ids, blocks=[6, 0, 11, 2])
    b = Sequence(b_ids, blocks=[4, 14, 1])
    cache = Cache(model)
    got_a: list[torch.Tensor] = []
    got_b: list[torch.Tensor] = []

    def step(plan: list[tuple[Sequence, int]]) -> None:
        for (seq, _), logits in zip(plan, run_step(model, cache, plan), strict=True):
            (got_a if seq is a else got_b).append(logits)

    step([(a, 5), (b, 8)])  # two prefills of different lengths
    step([(a, 6), (b, 1)])  # a prefill chunk beside a decode token
    while a.done < len(a_ids) or b.done < len(b_ids):  # decode both together, then a alone
        step([(s, 1) for s in (a, b) if s.done < len(s.ids)])
    assert torch.equal(torch.cat(got_a), expected_a)
    assert torch.equal(torch.cat(got_b), expected_b)
