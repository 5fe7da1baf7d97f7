"""A model whose every layer attends within a sliding window keeps only the KV blocks its window can
still see: the same logprobs, bitwise, as keeping every block, in a pool that stays bounded whatever
the context's length, through chunked prefill, speculative drafts, preemption and prefix-cache hits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.tiny_checkpoint import sharpen, write_byte_level_tokenizer
from tokenmill_service.contract.engine_config import EngineConfig
from tokenmill_service.contract.request import GenerationRequest, RequestOutput, StoppingParams
from tokenmill_service.contract.tokenizer.load import load_tokenizer
from tokenmill_service.worker.engine.llm_engine import LLMEngine
from tokenmill_service.worker.loader import load_model

WINDOW = 16
BLOCK = 4
PROMPT = [(i % 20) * 11 + 5 for i in range(3 * WINDOW + 5)]  # 53 tokens: past three windows; repeating, for drafts
NEW = 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import transformers

    path = tmp_path_factory.mktemp("mistral-window")
    write_byte_level_tokenizer(path)
    config = transformers.MistralConfig(
        vocab_size=257,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,  # the native attention kernel's
        max_position_embeddings=512,
        sliding_window=WINDOW,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    sharpen(transformers.MistralForCausalLM(config)).save_pretrained(path, safe_serialization=True)
    return path


def _load(path: Path, ops: str) -> tuple[Any, Any]:
    return load_model(path, dtype=torch.float32, quantization="none", backend=ops), load_tokenizer(path)


@pytest.fixture(scope="module")
def mistral(checkpoint: Path) -> tuple[Any, Any]:
    return _load(checkpoint, "torch")


def _engine(mistral: tuple[Any, Any], keep_every_block: bool = False, **kw: Any) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 64)
    engine = LLMEngine(*mistral, EngineConfig(block_size=BLOCK, max_batch_tokens=16, max_batch_size=4, **kw))
    if keep_every_block:
        engine.block_manager.window = None  # as before blocks were dropped: the reference
    return engine


def _request(rid: str, prompt_logprobs: bool = True, prompt: list[int] = PROMPT) -> GenerationRequest:
    return GenerationRequest(
        rid, prompt, stopping=StoppingParams(max_new_tokens=NEW), logprobs=True, prompt_logprobs=prompt_logprobs
    )


def _run(engine: LLMEngine) -> tuple[dict[str, list[RequestOutput]], int]:
    """Every request's outputs, and the most blocks the pool held at once (counted after scheduling:
    what a step runs with). Counts the preemptions in ``engine.preemptions``."""
    outs: dict[str, list[RequestOutput]] = {}
    peak = 0
    schedule = engine.scheduler.schedule

    def scheduled(max_model_len: int) -> Any:
        nonlocal peak
        batch = schedule(max_model_len)
        peak = max(peak, engine.block_manager.num_used_blocks)
        engine.preemptions += len(batch.preempted)  # type: ignore[attr-defined]
        return batch

    engine.preemptions = 0  # type: ignore[attr-defined]
    engine.scheduler.schedule = scheduled  # type: ignore[method-assign]
    while engine.has_unfinished():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    engine.scheduler.schedule = schedule  # type: ignore[method-assign]
    return outs, peak


def _logprobs(outs: list[RequestOutput]) -> list[tuple[int, float | None]]:
    return [(t.id, t.logprob) for o in outs for t in (*(o.prompt_tokens or []), *o.tokens)]


Reference = tuple[list[int], list[tuple[int, float | None]], int]


def _reference(mistral: tuple[Any, Any]) -> Reference:
    """A prompt 3x the window, its tokens and logprobs with every block kept, and the blocks that took."""
    kept = _engine(mistral, keep_every_block=True, speculative_tokens=0)
    kept.add_request(_request("probe"))
    greedy = [t.id for o in _run(kept)[0]["probe"] for t in o.tokens]
    # The prompt's first tokens made its greedy continuation's first three: they lie far beyond both
    # layers' windows, so the continuation stays the same, and its second token calls up n-gram drafts.
    prompt = greedy[:3] + PROMPT[3:]
    kept.add_request(_request("r", prompt=prompt))
    outs, peak = _run(kept)
    return prompt, _logprobs(outs["r"]), peak


@pytest.fixture(scope="module")
def reference(mistral: tuple[Any, Any]) -> Reference:
    return _reference(mistral)


@pytest.mark.parametrize("ops", ["native", "torch"])
def test_blocks_behind_the_window_are_freed_and_the_logprobs_do_not_change(
    checkpoint: Path, mistral: tuple[Any, Any], reference: Reference, ops: str
) -> None:
    if ops != "torch":  # the native kernel reads the keys of a 16-key tile, a dropped block's among them
        mistral = _load(checkpoint, ops)
        assert mistral[0].plan.ops.value == ops
        reference = _reference(mistral)
    prompt, want, kept_peak = reference
    assert kept_peak == -(
        -(len(prompt) + NEW - 1) // BLOCK
    )  # every block of the context (the last token is never stored)
    for spec in (0, 6):  # speculative drafts verify a few positions back
        engine = _engine(mistral, speculative_tokens=spec)
        start = engine.block_manager.num_free_blocks
        engine.add_request(_request("r", prompt=prompt))
        got, peak = _run(engine)
        assert _logprobs(got["r"]) == want
        bound = engine.block_manager.window_blocks_per_sequence(16)
        assert bound is not None and peak <= bound < kept_peak
        assert engine.drafts_proposed > 0 if spec else True
        assert engine.block_manager.num_free_blocks == start  # every block back once it finished
        assert all(b.ref_count == 0 for b in engine.block_manager.blocks)


def test_a_prefix_cache_hit_after_blocks_were_dropped_gives_the_same_tokens(mistral: tuple[Any, Any]) -> None:
    engine = _engine(mistral, speculative_tokens=0)
    engine.add_request(_request("first", prompt_logprobs=False))
    first, _ = _run(engine)
    engine.add_request(_request("again", prompt_logprobs=False))
    again, _ = _run(engine)
    assert engine.block_manager.prefix_hits > 0
    assert _logprobs(again["again"]) == _logprobs(first["first"])
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_pool_smaller_than_the_context_serves_it_and_preempts_without_changing_results(
    mistral: tuple[Any, Any], reference: Reference
) -> None:
    prompt, want, _ = reference
    # 12 blocks hold 48 tokens, fewer than one context of 61; each sequence needs at most 9 at once,
    # so two of them preempt each other, and each still gives the logprobs it gives alone.
    engine = _engine(mistral, num_kv_blocks=12, speculative_tokens=0)
    assert engine.max_model_len == 512
    # 9 blocks of 4 tokens, 2 layers' keys and values of 2 heads of 64 float32s (2 KiB a token).
    assert engine.kv_per_sequence == (
        "72 KiB, 36 tokens' blocks at most (every layer attends within a 16-token window: "
        "a full context without windows holds 1 MiB)"
    )
    for rid in ("a", "b"):
        engine.add_request(_request(rid, prompt=prompt))
    outs, peak = _run(engine)
    assert peak <= 12 and engine.preemptions > 0  # type: ignore[attr-defined]
    for rid in ("a", "b"):
        assert _logprobs(outs[rid]) == want, rid
    assert engine.block_manager.num_free_blocks == 12


def test_a_model_with_a_global_layer_frees_only_its_windowed_layers_blocks(tmp_path: Path) -> None:
    import transformers

    write_byte_level_tokenizer(tmp_path)
    # Qwen2's windows start at max_window_layers: layer 0 attends to the whole context, layer 1 to 16 keys.
    config = transformers.Qwen2Config(
        vocab_size=257,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        use_sliding_window=True,
        sliding_window=WINDOW,
        max_window_layers=1,
    )
    torch.manual_seed(0)
    sharpen(transformers.Qwen2ForCausalLM(config)).save_pretrained(tmp_path, safe_serialization=True)
    model = _load(tmp_path, "torch")
    assert model[0].attention_windows() == [None, WINDOW]
    kept = _engine(model, keep_every_block=True, speculative_tokens=0)
    kept.add_request(_request("r"))
    want, kept_peak = _run(kept)
    engine = _engine(model, speculative_tokens=0)
    # Two KV-cache groups of one layer each (worker/engine/kv_cache_groups.py): a block id holds one layer.
    assert engine.kv_groups.layers == ((0,), (1,)) and engine.block_manager.windowed == (False, True)
    engine.add_request(_request("r"))
    got, peak = _run(engine)
    assert _logprobs(got["r"]) == _logprobs(want["r"])
    full = -(-(len(PROMPT) + NEW - 1) // BLOCK)
    assert kept_peak == 2 * full  # both layers' blocks of the whole context
    # The global layer's 15 blocks, the windowed layer's at most 9 (16 keys of window, 16 of a chunk).
    assert engine.block_manager.window_blocks_per_sequence(16) == 9 and peak <= full + 9 < kept_peak
    # Its context is capped to what the pool of 64 one-layer blocks holds: 55 of the global layer, 9 of the other.
    assert engine.max_model_len == 220
