"""Running through the paged KV cache gives the logits of one full pass without a cache.

Uses the default model in float32. Prompts are prefilled in chunks and then decoded a token at a
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

from tokenmill_service.models.attention_metadata import AttentionMetadata
from tokenmill_service.models.llama import LlamaForCausalLM

REFERENCE = Path(__file__).parent / "data" / "smollm2_reference.json"
BLOCK_SIZE = 4
NUM_BLOCKS = 16
ATOL = 1e-4


@pytest.fixture
def model(default_model: LlamaForCausalLM) -> Iterator[LlamaForCausalLM]:
    """The session's float32 model (conftest.py) bound to a fresh cache of our own, unbound after."""
    config = default_model.config
    shape = (NUM_BLOCKS, BLOCK_SIZE, config.num_kv_heads, config.head_dim)
    layers = default_model.attention_layers
    previous = [(layer.k_cache, layer.v_cache) for layer in layers]
    for layer in layers:
        layer.k_cache, layer.v_cache = torch.zeros(shape), torch.zeros(shape)
    yield default_model
    for layer, (k_cache, v_cache) in zip(layers, previous, strict=True):
        layer.k_cache, layer.v_cache = k_cache, v_cache


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    data = json.loads(REFERENCE.read_text())["prompt_logprobs"]
    return [p["ids"] for p in sorted(data, key=lambda p: -len(p["ids"]))]


def full_pass_logits(model: LlamaForCausalLM, ids: list[int]) -> torch.Tensor:
    """Logits of every position from one pass over the whole sequence, no KV cache."""
    tokens = torch.tensor(ids)
    hidden = model(tokens, torch.arange(len(ids)), AttentionMetadata.no_cache([len(ids)]))
    return model.compute_logits(hidden)


class Sequence:
    """One sequence's tokens and blocks, and how far it has been run."""

    def __init__(self, ids: list[int], blocks: list[int]) -> None:
        self.ids = ids
        self.blocks = blocks
        self.done = 0  # tokens already in the cache

    def slot(self, position: int) -> int:
        return self.blocks[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE


def run_step(model: LlamaForCausalLM, steps: list[tuple[Sequence, int]]) -> list[torch.Tensor]:
    """Run the next ``n`` tokens of each sequence in one flat batch; the logits of each, in order."""
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    for seq, n in steps:
        new = range(seq.done, seq.done + n)
        ids += [seq.ids[p] for p in new]
        positions += list(new)
        slots += [seq.slot(p) for p in new]
    query_lens = [n for _, n in steps]
    context_lens = [seq.done + n for seq, n in steps]
    max_blocks = max(len(seq.blocks) for seq, _ in steps)
    block_tables = torch.tensor([seq.blocks + [0] * (max_blocks - len(seq.blocks)) for seq, _ in steps])
    meta = AttentionMetadata(
        query_lens=query_lens,
        context_lens=context_lens,
        slot_mapping=torch.tensor(slots),
        block_tables=block_tables,
        context_lens_tensor=torch.tensor(context_lens),
    )
    logits = model.compute_logits(model(torch.tensor(ids), torch.tensor(positions), meta))
    for seq, n in steps:
        seq.done += n
    return list(logits.split(query_lens))


@torch.inference_mode()
def test_chunked_prefill_then_decode_matches_a_full_pass(model: LlamaForCausalLM, prompts: list[list[int]]) -> None:
    ids = prompts[0][:17]
    expected = full_pass_logits(model, ids)
    seq = Sequence(ids, blocks=[9, 3, 12, 5, 0])  # 17 tokens need 5 blocks of 4
    got = run_step(model, [(seq, 6)])  # first prefill chunk ends mid-block
    got += run_step(model, [(seq, 7)])  # second chunk reads the first from the cache
    while seq.done < len(ids):
        got += run_step(model, [(seq, 1)])  # decode, one token per step
    torch.testing.assert_close(torch.cat(got), expected, atol=ATOL, rtol=0)


@torch.inference_mode()
def test_two_sequences_batched_through_the_cache_match_their_full_passes(
    model: LlamaForCausalLM, prompts: list[list[int]]
) -> None:
    a_ids, b_ids = prompts[0][:14], prompts[1][:11]
    expected_a, expected_b = full_pass_logits(model, a_ids), full_pass_logits(model, b_ids)
    # b's table is shorter and padded with 0, a block that a is using.
    a = Sequence(a_ids, blocks=[6, 0, 11, 2])
    b = Sequence(b_ids, blocks=[4, 14, 1])
    got_a: list[torch.Tensor] = []
    got_b: list[torch.Tensor] = []

    def step(plan: list[tuple[Sequence, int]]) -> None:
        for (seq, _), logits in zip(plan, run_step(model, plan), strict=True):
            (got_a if seq is a else got_b).append(logits)

    step([(a, 5), (b, 8)])  # two prefills of different lengths
    step([(a, 6), (b, 1)])  # a prefill chunk beside a decode token
    while a.done < len(a_ids) or b.done < len(b_ids):  # decode both together, then a alone
        step([(s, 1) for s in (a, b) if s.done < len(s.ids)])
    torch.testing.assert_close(torch.cat(got_a), expected_a, atol=ATOL, rtol=0)
    torch.testing.assert_close(torch.cat(got_b), expected_b, atol=ATOL, rtol=0)
