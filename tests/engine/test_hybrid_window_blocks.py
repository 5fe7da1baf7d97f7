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

from tests.engine.family_checks import load
from tests.engine.gemma_checkpoints import WINDOW, gemma2, gemma3
from tests.engine.test_window_blocks import _logprobs, _run
from tests.tiny_checkpoint import write_byte_level_tokenizer
from tokenmill_service.contract.engine_config import EngineConfig
from tokenmill_service.contract.request import GenerationRequest, StoppingParams
from tokenmill_service.contract.tokenizer.load import load_tokenizer
from tokenmill_service.worker.engine.block_manager import BlockManager
from tokenmill_service.worker.engine.kv_cache_groups import plan_kv_cache_groups
from tokenmill_service.worker.engine.llm_engine import LLMEngine

BLOCK = 4
CHUNK = 8  # tokens a step: prompts are prefilled in chunks
NEW = 4
# Three windows and more, of ids the tiny vocabulary holds; repeating, so that n-gram drafts are proposed.
PROMPT = [(i % 11) * 7 + 3 for i in range(3 * WINDOW + 9)]
CONTEXT = len(PROMPT) + NEW - 1  # tokens stored (the last is never)
FULL = -(-CONTEXT // BLOCK)  # 9 blocks of a whole context, per layer group
WINDOW_BLOCKS = -(-(WINDOW + CHUNK) // BLOCK) + 1  # 5: the most a local group's table holds


def test_layers_split_into_groups_of_one_size() -> None:
    w = WINDOW
    gemma3_groups = plan_kv_cache_groups([w] * 5 + [None])
    assert gemma3_groups.layers == ((0,), (1,), (2,), (3,), (4,), (5,))
    assert gemma3_groups.windows == (w,) * 5 + (None,)
    gemma2_groups = plan_kv_cache_groups([w, None, w, None])
    assert gemma2_groups.layers == ((0, 2), (1, 3)) and gemma2_groups.windows == (w, None)
    assert gemma2_groups.placement() == [(0, 0), (1, 0), (0, 1), (1, 1)]
    # Gemma-3-4B's 34 layers (every sixth global: 29 local, 5 global): groups of 5, the last local one of 4.
    gemma3_4b = plan_kv_cache_groups([None if i % 6 == 5 else w for i in range(34)])
    assert gemma3_4b.group_size == 5 and gemma3_4b.num_groups == 7 and gemma3_4b.windows.count(None) == 1
    assert gemma3_4b.layers[0] == (0, 1, 2, 3, 4) and (5, 11, 17, 23, 29) in gemma3_4b.layers
    assert sorted(len(g) for g in gemma3_4b.layers) == [4, 5, 5, 5, 5, 5, 5]
    assert sorted(layer for g in gemma3_4b.layers for layer in g) == list(range(34))
    # The README's figure: a 32k-token context with 1024-token windows, blocks of 16, chunks of 512 holds
    # the global group's 2048 blocks and each windowed group's 97, of five layers each (822 MiB at
    # Gemma-3-4B's 4 KiB per layer and token), where every layer's blocks of it would take 2048 x 34 / 5.
    shape = plan_kv_cache_groups([None if i % 6 == 5 else 1024 for i in range(34)])
    pool = BlockManager(num_blocks=1, block_size=16, group_windows=shape.windows)
    assert pool.blocks_per_sequence(32768, 512) == 2048 + 6 * 97 == 2630
    # Every layer windowed, or none, or the MTP drafter: one group, as before groups.
    assert plan_kv_cache_groups([w, w]).windows == (w,)
    assert plan_kv_cache_groups([None, None]).windows == (None,)
    assert plan_kv_cache_groups([w, None], keep_every_block=True).layers == ((0, 1),)


def _save(hf_model: Any, directory: Path) -> Path:
    hf_model.save_pretrained(directory, safe_serialization=True)
    write_byte_level_tokenizer(directory)
    return directory


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save(gemma3(), tmp_path_factory.mktemp("tiny-gemma3-hybrid"))


@pytest.fixture(scope="module")
def served(checkpoint: Path) -> tuple[Any, Any]:
    return load(checkpoint, "torch"), load_tokenizer(checkpoint)


Reference = tuple[list[tuple[int, float | None]], int]


def _keeping_every_block(model: Any, tokenizer: Any) -> Reference:
    """The prompt's logprobs with every layer's blocks in one table, every block kept (as before groups),
    the prompt prefilled in one step (where the others take chunks of 8), and the most blocks that took."""
    kept = _engine(model, tokenizer, keep_every_block=True, max_batch_tokens=64)
    kept.add_request(_request("r"))
    outs, peak = _run(kept)
    return _logprobs(outs["r"]), peak


@pytest.fixture(scope="module")
def reference(served: tuple[Any, Any]) -> Reference:
    return _keeping_every_block(*served)


def _engine(model: Any, tokenizer: Any, keep_every_block: bool = False, **kw: Any) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 96)
    kw.setdefault("speculative_tokens", 0)
    kw.setdefault("max_batch_tokens", CHUNK)
    config = EngineConfig(block_size=BLOCK, max_batch_size=4, **kw)
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
    assert engine.kv_groups.num_groups > 1
    return engine


def _request(rid: str, prompt_logprobs: bool = True) -> GenerationRequest:
    return GenerationRequest(
        rid, PROMPT, stopping=StoppingParams(max_new_tokens=NEW, ignore_eos=True), logprobs=True,
        prompt_logprobs=prompt_logprobs,
    )  # fmt: skip


def test_local_layers_free_blocks_behind_the_window_and_the_logprobs_do_not_change(
    served: tuple[Any, Any], reference: Reference
) -> None:
    want, kept_peak = reference
    assert kept_peak == FULL  # one table of 9 blocks, each holding all six layers
    engine = _engine(*served, speculative_tokens=4)
    bm = engine.block_manager
    assert engine.kv_groups.num_groups == 6 and engine.kv_groups.group_size == 1
    # Block ids hold one layer each now: the global group's 9, each local group's 5 at most.
    assert bm.blocks_per_sequence(CONTEXT, CHUNK) == FULL + 5 * WINDOW_BLOCKS == 34
    engine.add_request(_request("r"))
    got, peak = _run(engine)
    assert _logprobs(got["r"]) == want and engine.drafts_proposed > 0  # drafts checked, and rolled back
    # At most 34 one-layer blocks at once instead of 54 (9 blocks of six layers): the local layers' keys
    # and values behind the window are gone.
    assert peak <= 34 < 6 * kept_peak
    assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)

    # In a crowd, each the same as alone; and again from the prefix cache, the same tokens.
    engine = _engine(*served)
    bm = engine.block_manager
    for rid in ("a", "b"):
        engine.add_request(_request(rid))
    engine.step()
    engine.add_request(_request("hit", prompt_logprobs=False))  # waits for the others' prompt blocks
    crowd, _ = _run(engine)
    assert all(_logprobs(crowd[rid]) == want for rid in ("a", "b"))
    assert bm.prefix_hits > 0 and _logprobs(crowd["hit"]) == want[len(PROMPT) :]
    assert bm.num_free_blocks == bm.num_blocks


def test_the_native_kernel_reads_the_groups_tables(checkpoint: Path) -> None:
    model, tokenizer = load(checkpoint, "native"), load_tokenizer(checkpoint)
    want, _ = _keeping_every_block(model, tokenizer)
    engine = _engine(model, tokenizer)
    engine.add_request(_request("r"))
    got, peak = _run(engine)
    assert _logprobs(got["r"]) == want and peak <= 34


@pytest.mark.parametrize(("family", "ops"), [("gemma2", "triton"), ("gpt_oss", "torch"), ("gpt_oss", "native")])
def test_alternating_local_and_global_layers_free_the_local_layers_blocks(
    tmp_path: Path, family: str, ops: str
) -> None:
    """Gemma 2 (soft-capping) through triton under its interpreter, gpt-oss (attention sinks) through torch
    and through the native decoder stack (each layer its group's block tables, in one native call)."""
    from tests.engine.gpt_oss_checkpoint import hf_gpt_oss

    directory = _save(gemma2() if family == "gemma2" else hf_gpt_oss(), tmp_path)
    model, tokenizer = load(directory, ops), load_tokenizer(directory)
    assert model.attention_windows() == [WINDOW, None]
    assert (model.plan.executor.value == "native-stack") == (ops == "native"), model.plan.executor
    kept = _engine(model, tokenizer, keep_every_block=True)
    engine = _engine(model, tokenizer)
    assert engine.kv_groups.layers == ((0,), (1,))
    for e in (kept, engine):
        e.add_request(_request("r"))
    (want, kept_peak), (got, peak) = _run(kept), _run(engine)
    assert _logprobs(got["r"]) == _logprobs(want["r"])
    # The global layer's 9 blocks, the local layer's at most 5 (of one layer, where every block kept
    # holds both layers).
    assert kept_peak == FULL and peak <= FULL + WINDOW_BLOCKS < 2 * FULL


def test_a_pool_too_small_for_two_preempts_and_recomputes_without_changing_results(
    served: tuple[Any, Any], reference: Reference
) -> None:
    want, _ = reference
    # Two sequences need up to 2 x 34 blocks: 50 make them preempt each other (recomputed by prefill).
    engine = _engine(*served, num_kv_blocks=50, enable_prefix_caching=False)
    for rid in ("a", "b"):
        engine.add_request(_request(rid))
    outs, peak = _run(engine)
    assert peak <= 50 and engine.preemptions > 0  # type: ignore[attr-defined]
    for rid in ("a", "b"):
        assert _logprobs(outs[rid]) == want, rid
    assert engine.block_manager.num_free_blocks == 50


def test_the_same_kv_cache_memory_serves_a_longer_context(served: tuple[Any, Any]) -> None:
    model, tokenizer = served
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
