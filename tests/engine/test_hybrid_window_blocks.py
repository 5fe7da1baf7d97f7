"""A model that mixes windowed and global layers (Gemma 3: five local layers to one global) keeps, for its
windowed layers, only the blocks their window can still see: its layers are split into KV-cache groups
of one block table each, the global group's keeping every block, the local groups' freeing those behind
the window. The same logprobs, bitwise, as keeping every block for every layer, alone and in a crowd,
through chunked prefill, preemption (recomputed by prefill) and prefix-cache hits; fewer blocks held;
and a pool of the same memory serves a longer context."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.engine.family_checks import load
from tests.engine.gemma_checkpoints import WINDOW, gemma3
from tests.engine.test_window_blocks import _logprobs, _run
from tests.tiny_checkpoint import write_byte_level_tokenizer
from tokenmill_service.engine.config import EngineConfig
from tokenmill_service.engine.kv_cache_groups import plan_kv_cache_groups
from tokenmill_service.engine.llm_engine import LLMEngine
from tokenmill_service.engine.request import GenerationRequest, StoppingParams
from tokenmill_service.tokenizer.load import load_tokenizer

BLOCK = 4
CHUNK = 8  # tokens a step: prompts are prefilled in chunks
NEW = 6
# Three windows and more, of ids the tiny vocabulary holds.
PROMPT = torch.randint(0, 96, (3 * WINDOW + 13,), generator=torch.Generator().manual_seed(5)).tolist()
CONTEXT = len(PROMPT) + NEW - 1  # tokens stored (the last is never)
FULL = -(-CONTEXT // BLOCK)  # 11 blocks of a whole context, per layer group
WINDOW_BLOCKS = -(-(WINDOW + CHUNK) // BLOCK) + 1  # 5: the most a local group's table holds


def test_layers_split_into_groups_of_one_size() -> None:
    w = WINDOW
    gemma3_groups = plan_kv_cache_groups([w] * 5 + [None])
    assert gemma3_groups.layers == ((0,), (1,), (2,), (3,), (4,), (5,))
    assert gemma3_groups.windows == (w,) * 5 + (None,)
    gemma2_groups = plan_kv_cache_groups([w, None, w, None])
    assert gemma2_groups.layers == ((0, 2), (1, 3)) and gemma2_groups.windows == (w, None)
    assert gemma2_groups.placement() == [(0, 0), (1, 0), (0, 1), (1, 1)]
    # Gemma-3-1B's 26 layers (every sixth global, 22 local, 4 global): 13 groups of 2.
    gemma3_1b = plan_kv_cache_groups([None if i % 6 == 5 else w for i in range(26)])
    assert gemma3_1b.group_size == 2 and gemma3_1b.num_groups == 13
    assert gemma3_1b.windows.count(None) == 2
    # Every layer windowed, or none, or the MTP drafter: one group, as before groups.
    assert plan_kv_cache_groups([w, w]).windows == (w,)
    assert plan_kv_cache_groups([None, None]).windows == (None,)
    assert plan_kv_cache_groups([w, None], keep_every_block=True).layers == ((0, 1),)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-gemma3-hybrid")
    gemma3().save_pretrained(directory, safe_serialization=True)
    write_byte_level_tokenizer(directory)
    return directory


def _engine(model: Any, tokenizer: Any, keep_every_block: bool = False, **kw: Any) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 96)
    kw.setdefault("speculative_tokens", 0)
    config = EngineConfig(block_size=BLOCK, max_batch_tokens=CHUNK, max_batch_size=4, **kw)
    if keep_every_block:  # as before groups: every layer's blocks in one table, every block kept
        windows = model.attention_windows
        model.attention_windows = lambda: [None] * len(windows())
        try:
            engine = LLMEngine(model, tokenizer, config)
        finally:
            del model.attention_windows
        assert engine.kv_groups.num_groups == 1 and engine.block_manager.window is None
        return engine
    engine = LLMEngine(model, tokenizer, config)
    assert engine.kv_groups.num_groups == 6 and engine.kv_groups.group_size == 1
    return engine


def _request(rid: str, prompt_logprobs: bool = True) -> GenerationRequest:
    return GenerationRequest(
        rid, PROMPT, stopping=StoppingParams(max_new_tokens=NEW, ignore_eos=True), logprobs=True,
        prompt_logprobs=prompt_logprobs,
    )  # fmt: skip


@pytest.mark.parametrize("ops", ["torch", "native"])
def test_local_layers_free_blocks_behind_the_window_and_the_logprobs_do_not_change(checkpoint: Path, ops: str) -> None:
    model, tokenizer = load(checkpoint, ops), load_tokenizer(checkpoint)
    kept = _engine(model, tokenizer, keep_every_block=True)
    kept.add_request(_request("r"))
    outs, kept_peak = _run(kept)
    want = _logprobs(outs["r"])
    assert kept_peak == FULL  # one table of 11 blocks, each holding all six layers

    engine = _engine(model, tokenizer)
    bm = engine.block_manager
    # Block ids hold one layer each now: the global group's 11, each local group's 5 at most.
    assert bm.blocks_per_sequence(CONTEXT, CHUNK) == FULL + 5 * WINDOW_BLOCKS == 36
    engine.add_request(_request("r"))
    got, peak = _run(engine)
    assert _logprobs(got["r"]) == want
    # 30 one-layer blocks at once instead of 66 (11 blocks of six layers): the local layers' keys and
    # values behind the window are gone.
    assert peak == 30 < 6 * kept_peak
    assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)

    # In a crowd, each the same as alone; then again from the prefix cache, the same tokens.
    for rid in ("a", "b", "c"):
        engine.add_request(_request(rid))
    crowd, _ = _run(engine)
    assert all(_logprobs(crowd[rid]) == want for rid in ("a", "b", "c"))
    engine.add_request(_request("hit", prompt_logprobs=False))
    hits = bm.prefix_hits
    again, _ = _run(engine)
    assert bm.prefix_hits > hits
    assert _logprobs(again["hit"]) == want[len(PROMPT) :]
    assert bm.num_free_blocks == bm.num_blocks


def test_a_pool_too_small_for_two_preempts_and_recomputes_without_changing_results(checkpoint: Path) -> None:
    model, tokenizer = load(checkpoint, "torch"), load_tokenizer(checkpoint)
    kept = _engine(model, tokenizer, keep_every_block=True)
    kept.add_request(_request("r"))
    want = _logprobs(_run(kept)[0]["r"])
    engine = _engine(model, tokenizer, num_kv_blocks=50, enable_prefix_caching=False)
    for rid in ("a", "b"):
        engine.add_request(_request(rid))
    outs, peak = _run(engine)
    assert peak <= 50 and engine.preemptions > 0  # type: ignore[attr-defined]
    for rid in ("a", "b"):
        assert _logprobs(outs[rid]) == want, rid
    assert engine.block_manager.num_free_blocks == 50


def test_the_same_kv_cache_memory_serves_a_longer_context(checkpoint: Path) -> None:
    model, tokenizer = load(checkpoint, "torch"), load_tokenizer(checkpoint)
    # 16 blocks of every layer: 4 tokens of 6 layers' keys and values of 2 heads of 64 float32s each.
    memory = 16 * 6 * 2 * BLOCK * 2 * 64 * 4
    kept = _engine(model, tokenizer, keep_every_block=True, num_kv_blocks=0, kv_cache_memory=memory)
    engine = _engine(model, tokenizer, num_kv_blocks=0, kv_cache_memory=memory)
    assert (kept.block_manager.num_blocks, engine.block_manager.num_blocks) == (16, 96)
    assert kept.runner.k_cache.numel() == engine.runner.k_cache.numel()  # the same memory
    # 64 tokens' blocks of every layer, against the model's whole 256: a global layer's 64 blocks and
    # five local layers' 5 each fit in 96.
    assert kept.max_model_len == 64 and engine.max_model_len == 256
    # A sequence of the whole context: the global layer's 64 blocks and each local layer's 5, of 4 KiB each.
    assert engine.kv_per_sequence == (
        "356 KiB, 89 blocks of 1 layer(s) at most (5 of 6 layer groups attend within a 8-token window: "
        "a full context without windows holds 2 MiB)"
    )
