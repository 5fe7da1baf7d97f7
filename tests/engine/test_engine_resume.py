"""A resumed request (prompt + tokens already sent, `resume_ids`) continues the stream exactly:
the same tokens and logprobs as an uninterrupted run, text that joins across the seam (UTF-8 and
stop strings), and counts for the whole request. This is what the router relies on when it moves
a stream off a dead worker.

After a resume the tokens already sent are prefilled, not decoded one by one; the engine's numerics
do not depend on that (nor on the batch), and random draws are keyed by (seed, position), so a
greedy or seeded continuation is bit for bit the uninterrupted one.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.engine.test_engine import make_engine, run_all, text, token_ids
from tokenmill_service.contract.request import (
    FinishReason,
    GenerationRequest,
    RequestError,
    RequestOutput,
    SamplingParams,
    StoppingParams,
)
from tokenmill_service.worker.engine.detokenizer import IncrementalDetokenizer
from tokenmill_service.worker.engine.llm_engine import LLMEngine


@pytest.fixture(scope="module")
def engine(default_model: Any, default_tokenizer: Any) -> LLMEngine:
    return make_engine(default_model, default_tokenizer)


def run(engine: LLMEngine, request: GenerationRequest) -> list[RequestOutput]:
    engine.add_request(request)
    return run_all(engine)[request.request_id]


def logprobs(outs: list[RequestOutput]) -> list[float | None]:
    return [t.logprob for o in outs for t in o.tokens]


def request(engine: LLMEngine, rid: str, **kw: Any) -> GenerationRequest:
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": "Write a short poem about the sea."}])
    kw.setdefault("stopping", StoppingParams(max_new_tokens=20, ignore_eos=True))
    return GenerationRequest(rid, prompt, logprobs=True, **kw)


@pytest.mark.parametrize("cut", [1, 13])
def test_a_greedy_resumed_request_continues_with_the_same_tokens_and_logprobs(engine: LLMEngine, cut: int) -> None:
    whole = run(engine, request(engine, "whole"))
    ids = token_ids(whole)
    rest = run(engine, request(engine, "rest", resume_ids=ids[:cut]))
    assert token_ids(rest) == ids[cut:]
    assert logprobs(rest) == pytest.approx(logprobs(whole)[cut:], abs=1e-4)
    assert rest[-1].completion_len == len(ids) == 20  # usage counts the whole request
    assert rest[-1].finish_reason is FinishReason.LENGTH


def test_the_text_joins_across_the_seam_with_utf8_split_and_a_held_stop_string_start(engine: LLMEngine) -> None:
    # Find, in a greedy run, a point where the detokenizer holds text back, then resume there.
    whole = run(engine, request(engine, "whole-text", stopping=StoppingParams(max_new_tokens=24, ignore_eos=True)))
    ids, full = token_ids(whole), text(whole)
    # A stop string made of the end of one token's text and the start of the next one's: its first
    # part is held at the seam and must still be caught after it.
    pieces = [engine.tokenizer.token_text(i) for i in ids]
    k = next(i for i in range(4, len(ids) - 2) if len(pieces[i]) > 1 and len(pieces[i + 1]) > 1)
    stop = pieces[k][-1] + pieces[k + 1][:1]
    expected = full[: full.index(stop)] if stop in full else full
    stopping = StoppingParams(max_new_tokens=24, ignore_eos=True, stop=[stop])
    uninterrupted = run(engine, request(engine, "stop-whole", stopping=stopping))
    assert text(uninterrupted) == expected
    sent = [
        o for o in uninterrupted if sum(len(p.tokens) for p in uninterrupted[: uninterrupted.index(o) + 1]) <= k + 1
    ]
    sent_ids = token_ids(sent)
    rest = run(engine, request(engine, "stop-rest", stopping=stopping, resume_ids=sent_ids))
    assert text(sent) + text(rest) == expected
    assert token_ids(sent) + token_ids(rest) == token_ids(uninterrupted)
    assert rest[-1].finish_reason is uninterrupted[-1].finish_reason


def test_a_primed_detokenizer_emits_exactly_the_rest_at_every_seam(default_tokenizer: Any) -> None:
    # Multi-byte characters split across byte-level tokens, and stop strings whose start is held.
    tok = default_tokenizer
    ids = tok.encode("Caf\u00e9 au lait \U0001f600, cr\u00e8me br\u00fbl\u00e9e; stop here")
    for stops in ([], ["stop h"], ["\u00e8me b", "lait \U0001f600"]):
        whole = IncrementalDetokenizer(tok, stops)
        expected = "".join(whole.add(i) for i in ids) + whole.flush()
        for cut in range(len(ids) + 1):
            before = IncrementalDetokenizer(tok, stops)
            sent = "".join(before.add(i) for i in ids[:cut])
            after = IncrementalDetokenizer(tok, stops)
            after.prime(ids[:cut])
            assert after.text == sent
            rest = "".join(after.add(i) for i in ids[cut:]) + after.flush()
            assert sent + rest == expected, (stops, cut)


def test_a_seeded_resumed_request_continues_the_same_random_stream(engine: LLMEngine) -> None:
    sampling = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    whole = run(engine, request(engine, "seeded-whole", sampling=sampling))
    ids = token_ids(whole)
    rest = run(engine, request(engine, "seeded-rest", sampling=sampling, resume_ids=ids[:9]))
    assert token_ids(rest) == ids[9:]
    assert logprobs(rest) == pytest.approx(logprobs(whole)[9:], abs=1e-4)


def test_a_resumed_request_gives_bitwise_the_logprobs_of_an_uninterrupted_one(engine: LLMEngine) -> None:
    whole = run(engine, request(engine, "bitwise-whole"))
    rest = run(engine, request(engine, "bitwise-rest", resume_ids=token_ids(whole)[:5]))
    assert logprobs(rest) == logprobs(whole)[5:]


def test_a_resumed_request_with_nothing_left_to_generate_is_refused(engine: LLMEngine) -> None:
    req = request(engine, "done", stopping=StoppingParams(max_new_tokens=3), resume_ids=[42, 43, 44])
    with pytest.raises(RequestError, match="nothing left to generate"):
        engine.add_request(req)
