"""The engine on the real default model: generation, stops, limits, cancellation, batching."""

from __future__ import annotations

from typing import Any

import pytest

from tokenmill_service.contract.engine_config import EngineConfig
from tokenmill_service.contract.request import (
    FinishReason,
    GenerationRequest,
    RequestError,
    RequestOutput,
    SamplingParams,
    StoppingParams,
)
from tokenmill_service.worker.engine.llm_engine import KVPoolTooSmall, LLMEngine

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def make_engine(model: Any, tokenizer: Any, **kw: Any) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 256)
    return LLMEngine(model, tokenizer, EngineConfig(**kw))


def run_all(engine: LLMEngine) -> dict[str, list[RequestOutput]]:
    outs: dict[str, list[RequestOutput]] = {}
    for _ in range(10_000):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    assert not engine.has_unfinished()
    return outs


def token_ids(outs: list[RequestOutput]) -> list[int]:
    return [t.id for o in outs for t in o.tokens]


def text(outs: list[RequestOutput]) -> str:
    return "".join(o.text for o in outs)


@pytest.fixture(scope="module")
def engine(default_model: Any, default_tokenizer: Any) -> LLMEngine:
    return make_engine(default_model, default_tokenizer)


def test_capital_of_france_chat_answers_paris(engine: LLMEngine) -> None:
    ids = engine.tokenizer.encode_chat(FRANCE)
    engine.add_request(GenerationRequest("france", ids, stopping=StoppingParams(max_new_tokens=32)))
    outs = run_all(engine)["france"]
    assert "Paris" in text(outs)
    assert outs[-1].finish_reason is FinishReason.EOS
    assert "<|im_end|>" not in text(outs)  # the end-of-turn token ends the answer without text


def test_greedy_chat_continuations_equal_the_reference(engine: LLMEngine, reference: dict[str, Any]) -> None:
    for i, case in enumerate(reference["chat"]):
        assert engine.tokenizer.encode_chat(case["messages"]) == case["ids"]
        want = case["greedy_ids"]
        engine.add_request(
            GenerationRequest(
                f"chat{i}", case["ids"], stopping=StoppingParams(max_new_tokens=len(want)), top_logprobs=2
            )
        )
        outs = run_all(engine)[f"chat{i}"]
        got = token_ids(outs)
        tokens = [t for o in outs for t in o.tokens]
        for pos, (g, w) in enumerate(zip(got, want)):
            if g != w:
                top = tokens[pos].top_logprobs
                gap = top[0].logprob - top[1].logprob
                # Parting is only acceptable at a near tie, and then the rest is a different text.
                assert gap < 1e-3 and {top[0].id, top[1].id} == {g, w}, f"chat {i} parts at {pos}: gap {gap}"
                break
        else:
            assert got == want


def test_prompt_logprobs_match_the_reference(engine: LLMEngine, reference: dict[str, Any]) -> None:
    for i, case in enumerate(reference["prompt_logprobs"]):
        engine.add_request(
            GenerationRequest(
                f"plp{i}",
                case["ids"],
                stopping=StoppingParams(max_new_tokens=1),
                prompt_logprobs=True,
                top_logprobs=5,
            )
        )
        outs = run_all(engine)[f"plp{i}"]
        prompt = outs[0].prompt_tokens
        assert prompt is not None and len(prompt) == len(case["ids"])
        assert prompt[0].logprob is None and prompt[0].id == case["ids"][0]
        for tok, ref in zip(prompt[1:], case["positions"]):
            assert tok.id == ref["token"]
            assert tok.logprob is not None and abs(tok.logprob - ref["logprob"]) < 1e-3
            assert [t.id for t in tok.top_logprobs][:3] == [r[0] for r in ref["top"]][:3] or (
                abs(ref["top"][0][1] - ref["top"][1][1]) < 1e-3
            )


def test_stop_string_split_across_tokens_is_caught_and_not_emitted(engine: LLMEngine) -> None:
    ids = engine.tokenizer.encode_chat(FRANCE)
    engine.add_request(GenerationRequest("stop", ids, stopping=StoppingParams(max_new_tokens=32, stop=["ce is Pa"])))
    outs = run_all(engine)["stop"]
    assert outs[-1].finish_reason is FinishReason.STOP_SEQUENCE
    full = text(outs)
    assert full.endswith("Fran") and "ce is" not in full
    # Exactly the generated text up to the stop string: nothing of it, nothing held back before it.
    decoded = engine.tokenizer.decode(token_ids(outs))
    assert "ce is Pa" in decoded and full == decoded[: decoded.index("ce is Pa")]


def test_max_new_tokens_gives_length_finish(engine: LLMEngine) -> None:
    engine.add_request(
        GenerationRequest("len", engine.tokenizer.encode("Once upon a time"), stopping=StoppingParams(max_new_tokens=5))
    )
    outs = run_all(engine)["len"]
    assert len(token_ids(outs)) == 5 and outs[-1].finish_reason is FinishReason.LENGTH
    assert outs[-1].completion_len == 5 and outs[-1].prompt_len == 4


def test_end_of_context_is_its_own_finish_reason(default_model: Any, default_tokenizer: Any) -> None:
    engine = make_engine(default_model, default_tokenizer, max_model_len=20)
    prompt = default_tokenizer.encode("Once upon a time there was")
    engine.add_request(GenerationRequest("ctx", prompt, stopping=StoppingParams(max_new_tokens=0, ignore_eos=True)))
    outs = run_all(engine)["ctx"]
    assert outs[-1].finish_reason is FinishReason.CONTEXT_LIMIT
    assert len(prompt) + len(token_ids(outs)) == 20


def test_a_prompt_that_does_not_fit_states_both_numbers(default_model: Any, default_tokenizer: Any) -> None:
    engine = make_engine(default_model, default_tokenizer, max_model_len=16)
    with pytest.raises(RequestError, match=r"20 tokens.*16"):
        engine.add_request(GenerationRequest("big", list(range(100, 120))))
    with pytest.raises(RequestError, match=r"<= 16.*10 prompt tokens.*max_new_tokens 10"):
        engine.add_request(GenerationRequest("big2", list(range(100, 110)), stopping=StoppingParams(max_new_tokens=10)))


def test_bad_token_ids_and_empty_prompts_are_refused(engine: LLMEngine) -> None:
    with pytest.raises(RequestError, match="outside the vocabulary"):
        engine.add_request(GenerationRequest("bad", [1, 10**6]))
    with pytest.raises(RequestError, match="empty"):
        engine.add_request(GenerationRequest("empty", []))


def test_same_seed_same_tokens_and_different_seeds_differ(engine: LLMEngine) -> None:
    ids = engine.tokenizer.encode("The best thing about the weekend is")

    def draw(rid: str, seed: int) -> list[int]:
        engine.add_request(
            GenerationRequest(
                rid,
                ids,
                SamplingParams(temperature=1.0, top_p=0.95, seed=seed),
                StoppingParams(max_new_tokens=16, ignore_eos=True),
            )
        )
        return token_ids(run_all(engine)[rid])

    assert draw("a", 1) == draw("b", 1)
    assert draw("c", 1) != draw("d", 2)


def test_cancel_frees_blocks_at_once(engine: LLMEngine) -> None:
    engine.add_request(GenerationRequest("c", engine.tokenizer.encode("Tell me a story"), stopping=StoppingParams()))
    engine.step()
    assert engine.stats().kv_blocks_used > 0
    assert engine.cancel("c")
    assert engine.stats().kv_blocks_used == 0 and not engine.has_unfinished()
    assert not engine.cancel("c")


def test_tokens_are_identical_alone_and_among_fifteen_others(engine: LLMEngine) -> None:
    ids = engine.tokenizer.encode_chat([{"role": "user", "content": "Write a haiku about the sea."}])
    seeded = SamplingParams(temperature=0.8, top_k=50, seed=1234)
    stop = StoppingParams(max_new_tokens=24, ignore_eos=True)

    engine.add_request(GenerationRequest("alone-seeded", ids, seeded, stop))
    engine.add_request(GenerationRequest("alone-greedy", ids, SamplingParams(), stop))
    alone = run_all(engine)

    prompts = ["Hello", "List three colours.", "What is 2+2?", "Name a fruit.", "Why is the sky blue?"]
    early: list[RequestOutput] = []
    for i in range(14):
        other = engine.tokenizer.encode_chat([{"role": "user", "content": prompts[i % len(prompts)]}])
        engine.add_request(GenerationRequest(f"other{i}", other, SamplingParams(temperature=1.0), stop))
        if i == 6:  # the others keep arriving mid-flight, so the batch changes shape under the seeded request
            engine.add_request(GenerationRequest("crowd-seeded", ids, seeded, stop))
            early += [o for o in engine.step() if o.request_id == "crowd-seeded"]
    engine.add_request(GenerationRequest("crowd-greedy", ids, SamplingParams(), stop))
    crowd = run_all(engine)
    crowd["crowd-seeded"] = early + crowd["crowd-seeded"]
    assert token_ids(crowd["crowd-seeded"]) == token_ids(alone["alone-seeded"])
    assert token_ids(crowd["crowd-greedy"]) == token_ids(alone["alone-greedy"])


def test_preemption_under_a_tiny_cache_changes_no_tokens(default_model: Any, default_tokenizer: Any) -> None:
    prompts = [default_tokenizer.encode(f"Count from {i}:") for i in range(6)]
    stop = StoppingParams(max_new_tokens=20, ignore_eos=True)

    def generate(engine: LLMEngine) -> dict[str, list[int]]:
        for i, p in enumerate(prompts):
            engine.add_request(GenerationRequest(f"p{i}", p, stopping=stop))
        return {k: token_ids(v) for k, v in run_all(engine).items()}

    roomy = generate(make_engine(default_model, default_tokenizer, block_size=4))
    tight_engine = make_engine(default_model, default_tokenizer, block_size=4, num_kv_blocks=20)
    tight = generate(tight_engine)
    assert tight == roomy
    assert tight_engine.stats().kv_blocks_used == 0


def test_prefix_caching_shares_the_system_prompt_without_changing_tokens(
    default_model: Any, default_tokenizer: Any
) -> None:
    engine = make_engine(default_model, default_tokenizer, block_size=8)
    ids = default_tokenizer.encode_chat(FRANCE)
    stop = StoppingParams(max_new_tokens=8)
    engine.add_request(GenerationRequest("first", ids, stopping=stop))
    first = token_ids(run_all(engine)["first"])
    engine.add_request(GenerationRequest("second", ids, stopping=stop))
    seq = engine.sequences["second"]
    early = engine.step()
    # The system prompt's full blocks came from the cache; only the rest was computed.
    assert seq.num_cached_tokens == (len(ids) - 1) // 8 * 8 > 0
    second = token_ids(early + run_all(engine)["second"])
    assert second == first


def test_a_context_the_kv_pool_cannot_hold_is_refused_when_asked_and_capped_otherwise(
    default_model: Any, default_tokenizer: Any
) -> None:
    # 4 blocks of 16 tokens: a pool of 64 tokens.
    with pytest.raises(KVPoolTooSmall, match=r"--max-model-len 128 needs .*pool holds 64 tokens.*--kv-cache-memory"):
        make_engine(default_model, default_tokenizer, num_kv_blocks=4, max_model_len=128)
    assert make_engine(default_model, default_tokenizer, num_kv_blocks=4).max_model_len == 64
    assert make_engine(default_model, default_tokenizer, num_kv_blocks=4, max_model_len=64).max_model_len == 64


def test_choices_of_one_request_share_the_prompts_blocks_and_each_draws_as_alone(
    default_model: Any, default_tokenizer: Any
) -> None:
    """n > 1: the choices (one prefix group, seeds from choice_seed) compute the prompt once; each gives
    the tokens it gives alone, in a fresh engine, with its own seed."""
    from tokenmill_service.contract.request import choice_seed

    ids = default_tokenizer.encode_chat([{"role": "user", "content": "Write a haiku about the sea."}])
    stop = StoppingParams(max_new_tokens=6, ignore_eos=True)

    def sampling(i: int) -> SamplingParams:
        return SamplingParams(temperature=1.0, top_k=50, seed=choice_seed(99, i))

    engine = make_engine(default_model, default_tokenizer, block_size=8)
    for i in range(3):
        engine.add_request(GenerationRequest(f"c{i}", ids, sampling(i), stop, prefix_group="g"))
    choices = {k: token_ids(v) for k, v in run_all(engine).items()}
    shared = (len(ids) - 1) // 8 * 8
    assert engine.block_manager.prefix_hits == 2 * shared > 0  # choices 1 and 2 took choice 0's blocks

    alone = make_engine(default_model, default_tokenizer, block_size=8)
    for i in range(3):
        alone.add_request(GenerationRequest(f"a{i}", ids, sampling(i), stop))
        assert token_ids(run_all(alone)[f"a{i}"]) == choices[f"c{i}"]
    assert len({tuple(c) for c in choices.values()}) == 3  # three seeds, three different draws
    assert choice_seed(99, 0) == 99
