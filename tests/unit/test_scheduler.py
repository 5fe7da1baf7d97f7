"""The scheduler's admission rules: batch size, token budget, chunked prefill, preemption."""

from __future__ import annotations

from typing import Any

from tokenmill_service.contract.engine_config import EngineConfig
from tokenmill_service.contract.request import GenerationRequest
from tokenmill_service.worker.engine.block_manager import BlockManager
from tokenmill_service.worker.engine.scheduler import Scheduler
from tokenmill_service.worker.engine.sequence import Sequence, SequenceStatus


def seq(tokenizer: Any, n: int, rid: str) -> Sequence:
    return Sequence(GenerationRequest(rid, list(range(10, 10 + n))), tokenizer)


def run_step(sched: Scheduler) -> list[tuple[str, int]]:
    """Schedule, then pretend the model ran: mark tokens computed and add one sampled token
    (speculation off: these tests are about admission, and a pretend token repeats)."""
    batch = sched.schedule()
    for s, n in zip(batch.seqs, batch.num_new_tokens):
        s.num_computed_tokens += n
        if s.num_computed_tokens == s.num_tokens:
            s.token_ids.append(1)
    return [(s.request_id, n) for s, n in zip(batch.seqs, batch.num_new_tokens)]


def test_admits_waiting_requests_up_to_max_batch_size(default_tokenizer: Any) -> None:
    cfg = EngineConfig(max_batch_size=2, max_batch_tokens=64, enable_prefix_caching=False, speculative_tokens=0)
    sched = Scheduler(cfg, BlockManager(64, 4, False))
    for i in range(3):
        sched.add(seq(default_tokenizer, 5, f"r{i}"))
    assert run_step(sched) == [("r0", 5), ("r1", 5)]
    assert [s.request_id for s in sched.waiting] == ["r2"]
    assert run_step(sched) == [("r0", 1), ("r1", 1)]  # both decode; r2 still waits


def test_long_prompts_are_prefilled_in_chunks_while_decodes_flow(default_tokenizer: Any) -> None:
    cfg = EngineConfig(max_batch_size=4, max_batch_tokens=8, enable_prefix_caching=False, speculative_tokens=0)
    sched = Scheduler(cfg, BlockManager(64, 4, False))
    sched.add(seq(default_tokenizer, 3, "short"))
    assert run_step(sched) == [("short", 3)]
    sched.add(seq(default_tokenizer, 20, "long"))
    # Each step: the running decode first, then as much of the long prompt as the budget allows.
    assert run_step(sched) == [("short", 1), ("long", 7)]
    assert run_step(sched) == [("short", 1), ("long", 7)]
    assert run_step(sched) == [("short", 1), ("long", 6)]
    assert run_step(sched) == [("short", 1), ("long", 1)]


def test_a_step_beside_decoding_streams_takes_fewer_prompt_tokens(default_tokenizer: Any) -> None:
    cfg = EngineConfig(max_batch_size=2, max_batch_tokens=8, max_batch_tokens_decoding=4, speculative_tokens=0)
    sched = Scheduler(cfg, BlockManager(64, 4, False))
    sched.add(seq(default_tokenizer, 20, "first"))
    assert run_step(sched) == [("first", 8)]  # nothing decodes: chunks of max_batch_tokens
    assert run_step(sched) == [("first", 8)]
    sched.add(seq(default_tokenizer, 20, "second"))
    assert run_step(sched) == [("first", 4), ("second", 4)]  # still prefilling: the whole budget
    assert run_step(sched) == [("first", 1), ("second", 3)]  # first decodes: 4 tokens a step
    assert run_step(sched) == [("first", 1), ("second", 3)]


def test_by_default_prompts_beside_a_decoding_stream_go_256_tokens_a_step(default_tokenizer: Any) -> None:
    sched = Scheduler(EngineConfig(speculative_tokens=0), BlockManager(256, 16, False))
    sched.add(seq(default_tokenizer, 600, "long"))
    assert run_step(sched) == [("long", 512)]  # alone: --max-batch-tokens' 512
    sched.add(seq(default_tokenizer, 1000, "next"))
    assert run_step(sched) == [("long", 88), ("next", 424)]
    assert run_step(sched) == [("long", 1), ("next", 255)]  # "long" decodes: 256 a step, its token included
    assert run_step(sched) == [("long", 1), ("next", 255)]
    assert run_step(sched) == [("long", 1), ("next", 66)]


def test_the_decoding_budget_still_holds_a_token_for_every_sequence(default_tokenizer: Any) -> None:
    cfg = EngineConfig(max_batch_size=4, max_batch_tokens=8, max_batch_tokens_decoding=1, speculative_tokens=0)
    sched = Scheduler(cfg, BlockManager(64, 4, False))
    for i in range(4):
        sched.add(seq(default_tokenizer, 2, f"r{i}"))
    assert run_step(sched) == [(f"r{i}", 2) for i in range(4)]
    assert run_step(sched) == [(f"r{i}", 1) for i in range(4)]  # four decodes, though the budget says one


def test_token_budget_limits_admission(default_tokenizer: Any) -> None:
    cfg = EngineConfig(max_batch_size=8, max_batch_tokens=10, enable_prefix_caching=False, speculative_tokens=0)
    sched = Scheduler(cfg, BlockManager(64, 4, False))
    sched.add(seq(default_tokenizer, 6, "a"))
    sched.add(seq(default_tokenizer, 6, "b"))
    assert run_step(sched) == [("a", 6), ("b", 4)]  # b starts its prefill with what is left


def test_out_of_blocks_preempts_the_newest_and_requeues_it_first(default_tokenizer: Any) -> None:
    cfg = EngineConfig(max_batch_size=4, max_batch_tokens=64, enable_prefix_caching=False, speculative_tokens=0)
    bm = BlockManager(4, 4, False)
    sched = Scheduler(cfg, bm)
    old, new = seq(default_tokenizer, 8, "old"), seq(default_tokenizer, 8, "new")
    sched.add(old)
    sched.add(new)
    assert run_step(sched) == [("old", 8), ("new", 8)]  # 4 blocks, all used
    # Both need a third block to decode; the pool is empty, so the newest gives its blocks up.
    assert run_step(sched) == [("old", 1)]
    assert new.status is SequenceStatus.WAITING and sched.waiting[0] is new
    assert new.num_computed_tokens == 0 and new.block_table == []
    assert bm.num_used_blocks == 3


def test_finish_returns_blocks_at_once(default_tokenizer: Any) -> None:
    cfg = EngineConfig(max_batch_size=4, max_batch_tokens=64, enable_prefix_caching=False, speculative_tokens=0)
    bm = BlockManager(16, 4, False)
    sched = Scheduler(cfg, bm)
    s = seq(default_tokenizer, 9, "a")
    sched.add(s)
    run_step(sched)
    assert bm.num_used_blocks == 3
    sched.finish(s)
    assert bm.num_used_blocks == 0 and not sched.has_unfinished()


def test_drafts_fit_the_token_budget_the_blocks_and_the_batch_limit(default_tokenizer: Any) -> None:
    cfg = EngineConfig(max_batch_size=4, max_batch_tokens=6, speculative_tokens=8, speculative_max_batch=1)
    bm = BlockManager(8, 4, False)
    sched = Scheduler(cfg, bm)
    s = Sequence(GenerationRequest("loop", [5, 6, 7, 5, 6, 7, 5, 6]), default_tokenizer)
    sched.add(s)
    assert [n for n in sched.schedule().num_new_tokens] == [6]  # a prefill chunk: no drafts
    s.num_computed_tokens = 6
    batch = sched.schedule()
    assert batch.num_new_tokens == [2] and s.drafts == []  # the prompt's last two tokens are not decoding
    s.num_computed_tokens = 8
    s.token_ids.append(7)
    batch = sched.schedule()
    # Decoding: the last four tokens [7, 5, 6, 7] occurred three tokens back; read on with that period.
    assert s.drafts == [5, 6, 7, 5, 6] and batch.num_new_tokens == [6]  # five fit the budget beside the token
    assert len(s.block_table) * 4 >= s.num_computed_tokens + 6
    cfg.speculative_tokens = 2
    s.drafts = []
    assert sched.schedule().num_new_tokens == [3] and s.drafts == [5, 6]
    cfg.speculative_tokens, cfg.max_batch_tokens = 8, 3
    s.drafts = []
    assert sched.schedule().num_new_tokens == [3] and s.drafts == [5, 6]  # the token budget
    cfg.max_batch_tokens = 16
    # A second running sequence: over speculative_max_batch, no drafts for either.
    other = Sequence(GenerationRequest("other", [9, 9, 9]), default_tokenizer)
    sched.add(other)
    s.drafts = []
    sched.schedule()
    s.drafts = []
    assert sched.schedule().num_new_tokens[0] == 1 and s.drafts == []


def test_choices_of_one_request_wait_for_their_shared_prompt_then_take_its_blocks(default_tokenizer: Any) -> None:
    """n > 1: one choice computes the prompt (in chunks here); its siblings start once the prompt's full
    blocks are cached and compute only the last, partial block. Other requests are not held back."""
    cfg = EngineConfig(max_batch_size=8, max_batch_tokens=8, enable_prefix_caching=True, speculative_tokens=0)
    blocks = BlockManager(64, 4, True)
    sched = Scheduler(cfg, blocks)
    prompt = list(range(10, 24))  # 14 tokens: 3 full blocks of 4 and 2 tokens more
    for i in range(3):
        sched.add(Sequence(GenerationRequest(f"c{i}", prompt, prefix_group="g"), default_tokenizer))
    sched.add(seq(default_tokenizer, 3, "other"))

    def step() -> list[tuple[str, int]]:
        scheduled = run_step(sched)
        for s in sched.running:
            blocks.register_computed_blocks(s)
        return scheduled

    assert step() == [("c0", 8)]  # the others of its group wait; "other" waits for budget
    assert step() == [("c0", 6), ("other", 2)]
    assert step() == [("c0", 1), ("other", 1), ("c1", 2), ("c2", 2)]  # 12 of 14 tokens from the cache
    c0, _other, c1, c2 = sched.running
    assert c1.num_cached_tokens == c2.num_cached_tokens == 12
    assert c1.block_table[:3] == c2.block_table[:3] == c0.block_table[:3]
    assert c1.block_table[3] != c2.block_table[3] != c0.block_table[3]
