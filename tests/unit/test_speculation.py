"""Speculation (prompt lookup): drafts guessed from a sequence's own history and checked in the
same step change the speed, never the tokens, their logprobs or where a request stops."""

from __future__ import annotations

from typing import Any

import pytest

from tokenmill_service.contract.config import Settings, load_settings
from tokenmill_service.contract.engine_config import EngineConfig
from tokenmill_service.contract.request import GenerationRequest, RequestOutput, SamplingParams, StoppingParams
from tokenmill_service.worker.engine.llm_engine import LLMEngine
from tokenmill_service.worker.engine.speculation import propose_drafts

REPEAT = "Repeat this line ten times: the cat sat on the mat, the dog sat on the log."


def test_drafts_follow_the_latest_earlier_occurrence_of_the_longest_suffix() -> None:
    assert propose_drafts([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 3) == [7, 5, 1]  # latest: ...3, 7
    assert propose_drafts([5, 6, 1, 2, 8, 4, 1, 2], 4) == [8, 4, 1, 2]
    assert propose_drafts([1, 2, 3, 4, 5], 4) == []  # no suffix of two or more occurred before
    assert propose_drafts([1, 2, 1, 2], 0) == []
    # A four-token match wins over a later two-token one.
    assert propose_drafts([1, 2, 3, 4, 50, 9, 3, 4, 60, 1, 2, 3, 4], 1) == [50]
    # Past the end of the history the text is read on with the match's period.
    assert propose_drafts([7, 7, 7], 5) == [7, 7, 7, 7, 7]
    assert propose_drafts([4, 1, 2, 3, 1, 2, 3], 7) == [1, 2, 3, 1, 2, 3, 1]


def _engine(model: Any, tokenizer: Any, **kw: Any) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 256)
    return LLMEngine(model, tokenizer, EngineConfig(**kw))


def _run(engine: LLMEngine, requests: list[GenerationRequest]) -> dict[str, list[RequestOutput]]:
    for r in requests:
        engine.add_request(r)
    outs: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    assert engine.stats().kv_blocks_used == 0
    return outs


def _view(outs: list[RequestOutput]) -> tuple[Any, ...]:
    """Everything a caller sees, floats compared bitwise."""
    tokens = [(t.id, t.text, t.logprob, [(a.id, a.logprob) for a in t.top_logprobs]) for o in outs for t in o.tokens]
    return tokens, "".join(o.text for o in outs), outs[-1].finish_reason, outs[-1].completion_len


def _requests(tokenizer: Any, max_new: int = 48, **stopping: Any) -> list[GenerationRequest]:
    ids = tokenizer.encode_chat([{"role": "user", "content": REPEAT}])
    stop = StoppingParams(max_new_tokens=max_new, ignore_eos=True, **stopping)
    return [
        GenerationRequest("greedy", ids, SamplingParams(), stop, logprobs=True, top_logprobs=3),
        GenerationRequest("seeded", ids, SamplingParams(temperature=0.7, top_k=40, seed=11), stop, logprobs=True),
        GenerationRequest(
            "penalized", ids, SamplingParams(temperature=0.9, top_p=0.9, repetition_penalty=1.1, seed=5), stop
        ),
    ]


@pytest.fixture(scope="module")
def plain(served_model: Any, default_tokenizer: Any) -> dict[str, list[RequestOutput]]:
    return _run(_engine(served_model, default_tokenizer, speculative_tokens=0), _requests(default_tokenizer))


def test_speculation_gives_the_same_tokens_logprobs_and_text_bit_for_bit(
    served_model: Any, default_tokenizer: Any, plain: dict[str, list[RequestOutput]]
) -> None:
    engine = _engine(served_model, default_tokenizer)  # the default: speculation on
    fast = _run(engine, _requests(default_tokenizer))
    for rid, want in plain.items():
        assert _view(fast[rid]) == _view(want), rid
    stats = engine.stats()
    # The repeated line is guessed right most of the time, and some guesses are wrong: both paths ran.
    assert stats.draft_tokens_accepted > 20
    assert stats.draft_tokens_proposed > stats.draft_tokens_accepted
    # Several tokens came out of one step: fewer outputs than tokens.
    assert len(fast["greedy"]) < len(plain["greedy"])


def test_speculation_stops_where_plain_decoding_stops(served_model: Any, default_tokenizer: Any) -> None:
    for stopping, max_new in (({"stop": ["mat, the dog"]}, 48), ({}, 13)):
        requests = _requests(default_tokenizer, max_new, **stopping)
        want = _run(_engine(served_model, default_tokenizer, speculative_tokens=0), requests)
        got = _run(_engine(served_model, default_tokenizer), _requests(default_tokenizer, max_new, **stopping))
        for rid in want:
            assert _view(got[rid]) == _view(want[rid]), (rid, stopping, max_new)


def test_speculation_at_the_end_of_the_context_and_in_a_tiny_cache(
    served_model: Any, default_tokenizer: Any, plain: dict[str, list[RequestOutput]]
) -> None:
    prompt_len = len(default_tokenizer.encode_chat([{"role": "user", "content": REPEAT}]))
    # Until the end of a short context (no max_new_tokens); then with preemptions.
    for max_new, kw in ((0, {"max_model_len": prompt_len + 20}), (48, {"block_size": 4, "num_kv_blocks": 40})):
        want = _run(
            _engine(served_model, default_tokenizer, speculative_tokens=0, **kw), _requests(default_tokenizer, max_new)
        )
        got = _run(_engine(served_model, default_tokenizer, **kw), _requests(default_tokenizer, max_new))
        for rid in want:
            assert _view(got[rid]) == _view(want[rid]), (rid, kw)


def test_a_prefix_cached_resend_with_speculation_is_unchanged(
    served_model: Any, default_tokenizer: Any, plain: dict[str, list[RequestOutput]]
) -> None:
    engine = _engine(served_model, default_tokenizer, block_size=8)
    first = _run(engine, _requests(default_tokenizer)[:1])
    again = _run(engine, _requests(default_tokenizer)[:1])
    assert engine.stats().prefix_cache_hits > 0
    assert _view(first["greedy"]) == _view(again["greedy"]) == _view(plain["greedy"])


def test_no_drafts_beyond_the_batch_limit(served_model: Any, default_tokenizer: Any) -> None:
    engine = _engine(served_model, default_tokenizer, speculative_max_batch=2)
    _run(engine, _requests(default_tokenizer, 24))  # three sequences: over the limit throughout
    assert engine.stats().draft_tokens_proposed == 0


def test_the_speculation_settings_default_to_six_drafts_at_four_sequences_and_refuse_negatives() -> None:
    assert (Settings().speculative_tokens, Settings().speculative_max_batch) == (6, 4)
    assert load_settings(["--speculative-tokens", "0"], {}).speculative_tokens == 0
    assert load_settings([], {"TOKENMILL_SPECULATIVE_MAX_BATCH": "8"}).speculative_max_batch == 8
    with pytest.raises(ValueError, match="--speculative-tokens must not be negative"):
        load_settings(["--speculative-tokens", "-1"], {})
    with pytest.raises(ValueError, match="must not be negative"):
        EngineConfig(speculative_max_batch=-1)
