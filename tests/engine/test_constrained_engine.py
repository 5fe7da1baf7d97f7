"""Constrained decoding in the engine on the served default model: drafts checked against the grammar,
preemption and resumption replaying the grammar, the same tokens and logprobs either way."""

from __future__ import annotations

import json
from typing import Any

from tests.engine.test_engine import make_engine, run_all
from tokenmill_service.contract.request import (
    Constraint,
    FinishReason,
    GenerationRequest,
    RequestOutput,
    SamplingParams,
    StoppingParams,
)
from tokenmill_service.worker.engine.llm_engine import LLMEngine

# Repetitive on purpose: the prompt-lookup drafter proposes guesses, some of which the grammar refuses.
LIST = Constraint(
    "json_schema",
    json.dumps({"type": "array", "items": {"enum": ["alpha", "beta", "gamma"]}, "minItems": 6, "maxItems": 6}),
)
PROMPT = 'Repeat: ["alpha", "beta", "alpha", "beta", "alpha", "beta"] and ["alpha", "beta", "gamma"]'


def trace(outs: list[RequestOutput]) -> list[tuple[int, float | None]]:
    return [(t.id, t.logprob) for o in outs for t in o.tokens]


def requests(tokenizer: Any) -> list[GenerationRequest]:
    ids = tokenizer.encode_chat([{"role": "user", "content": PROMPT}])
    return [
        GenerationRequest(f"r{i}", ids, sampling, StoppingParams(max_new_tokens=40), logprobs=True, constraint=LIST)
        for i, sampling in enumerate([SamplingParams(), SamplingParams(temperature=1.0, seed=5)])
    ]


def test_drafts_are_checked_against_the_grammar_and_change_nothing(served_model: Any, default_tokenizer: Any) -> None:
    results = {}
    for drafts in (0, 6):
        engine = make_engine(served_model, default_tokenizer, speculative_tokens=drafts)
        for r in requests(default_tokenizer):
            engine.add_request(r)
        outs = run_all(engine)
        results[drafts] = {k: trace(v) for k, v in outs.items()}
        for v in outs.values():
            assert v[-1].finish_reason is FinishReason.EOS
            assert len(json.loads("".join(o.text for o in v))) == 6
        if drafts:
            assert engine.drafts_proposed > 0
    assert results[0] == results[6]


def test_preempted_and_resumed_sequences_replay_their_grammar(served_model: Any, default_tokenizer: Any) -> None:
    whole = make_engine(served_model, default_tokenizer)
    for r in requests(default_tokenizer):
        whole.add_request(r)
    expected = {k: trace(v) for k, v in run_all(whole).items()}
    # A pool that holds both prompts but not both answers: one is preempted and recomputed, its grammar kept.
    prompt_blocks = -(-(len(requests(default_tokenizer)[0].prompt_ids) + 1) // 16)
    tight: LLMEngine = make_engine(
        served_model, default_tokenizer, num_kv_blocks=2 * prompt_blocks + 1, speculative_tokens=0
    )
    preempted: list[str] = []
    preempt = tight.scheduler._preempt
    tight.scheduler._preempt = lambda seq, batch: (preempted.append(seq.request_id), preempt(seq, batch))[1]  # type: ignore[method-assign]
    for r in requests(default_tokenizer):
        tight.add_request(r)
    assert {k: trace(v) for k, v in run_all(tight).items()} == expected
    assert preempted
    # Resumed elsewhere from the first 5 tokens: the grammar is replayed over them, the rest is the same.
    for r in requests(default_tokenizer):
        sent = [t for t, _ in expected[r.request_id][:5]]
        resumed = make_engine(served_model, default_tokenizer)
        r.resume_ids = sent
        resumed.add_request(r)
        assert trace(run_all(resumed)[r.request_id]) == expected[r.request_id][5:]


def test_a_drafted_stop_token_after_the_grammar_ends_leaves_its_matcher_as_it_was(default_tokenizer: Any) -> None:
    """The prompt-lookup drafter proposes the answer's end and the turn's end together when the prompt shows
    them (a forced tool call's example): the masks computed over those drafts must leave the matcher able to
    take the answer's last token (it once refused it, and the answer ended one token short)."""
    from tokenmill_service.contract.grammar import GrammarCompiler
    from tokenmill_service.worker.engine.token_masks import MaskFiller, MaskJob

    matcher = GrammarCompiler(default_tokenizer).matcher(Constraint("json_schema", json.dumps({"enum": ["alpha"]})))
    ids = default_tokenizer.encode('"alpha"')
    stops = sorted(default_tokenizer.stop_token_ids)
    assert matcher.consume_tokens(ids[:-1])
    drafts = [ids[-1], stops[0], ids[0]]
    MaskFiller(default_tokenizer.vocab_size).submit([MaskJob(0, matcher, drafts, stops)], len(drafts) + 1).result()
    assert matcher.consume_token(ids[-1]) and matcher.is_accepting(), matcher.get_error()
