"""DeepSeek-V3's multi-token-prediction layer as the speculation draft (``speculative_method="mtp"``): on
a tiny random DeepSeek-V3 with a random MTP layer added to its file, the same tokens, logprobs and text bit
for bit with MTP drafts and without (greedy, seeded and penalized sampling, several requests in one batch
against each alone, a prompt from the prefix cache), and the drafts counted; with an MTP layer built to
predict what the model samples, nearly every draft is kept and a request takes a fraction of the steps;
at two tensor-parallel ranks, the drafts of one rank and the tokens of the two ranks without drafts."""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.engine.mtp_ranks import Drafted, replica_rank, run_drafting
from tests.rank_processes import run_ranks
from tests.tiny_checkpoint import write_byte_level_tokenizer
from tests.tiny_deepseek import add_mtp_layer, deepseek_v3, quantize_fp8
from tokenmill_service.contract.engine_config import EngineConfig
from tokenmill_service.contract.model_paths import ModelLoadError
from tokenmill_service.contract.plan.plan import PlanRefused
from tokenmill_service.contract.request import GenerationRequest, RequestOutput, SamplingParams, StoppingParams
from tokenmill_service.contract.tokenizer.load import load_tokenizer
from tokenmill_service.worker.engine.llm_engine import LLMEngine
from tokenmill_service.worker.loader import load_model

pytest.importorskip("transformers")

PROMPT = list(b"Multi-token prediction: ")


@pytest.fixture(scope="module")
def random_mtp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three layers (the first dense, then routed and shared experts) and an MTP layer with experts; for
    two tensor-parallel ranks, an even vocabulary (bytes, EOS and a pad token) and experts 64 wide, so
    that each rank's half is whole blocks of the native kernels (a narrower one takes the sliced product,
    which is not batch-invariant on every CPU: worker/layers/quant/dense.py)."""
    directory = tmp_path_factory.mktemp("deepseek-random-mtp")
    write_byte_level_tokenizer(directory, "<|pad|>")
    deepseek_v3(q_lora=True, vocab_size=258, moe=True, moe_intermediate_size=64).save_pretrained(
        directory, safe_serialization=True
    )
    add_mtp_layer(directory)
    return directory


@pytest.fixture(scope="module")
def predicting_mtp(random_mtp: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same made to predict (``add_mtp_layer``'s ``predicting``)."""
    directory = tmp_path_factory.mktemp("deepseek-predicting-mtp")
    shutil.copytree(random_mtp, directory, dirs_exist_ok=True)
    add_mtp_layer(directory, predicting=True)
    return directory


def _config(method: str, **kw: Any) -> EngineConfig:
    kw.setdefault("speculative_tokens", 0 if method == "ngram" else 3)
    return EngineConfig(num_kv_blocks=64, block_size=4, speculative_method=method, **kw)


def _engine(directory: Path, method: str, quantization: str = "none", **kw: Any) -> LLMEngine:
    model = load_model(directory, quantization=quantization, speculative_method=method)
    return LLMEngine(model, load_tokenizer(directory), _config(method, **kw))


def _run(engine: LLMEngine, requests: list[GenerationRequest]) -> tuple[dict[str, list[RequestOutput]], int]:
    """Every request's outputs, and the steps taken."""
    for r in requests:
        engine.add_request(r)
    outs: dict[str, list[RequestOutput]] = {}
    steps = 0
    while engine.has_unfinished():
        steps += 1
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    assert engine.stats().kv_blocks_used == 0
    return outs, steps


def _view(outs: list[RequestOutput]) -> tuple[Any, ...]:
    """Everything a caller sees, floats compared bitwise."""
    tokens = [(t.id, t.logprob, [(a.id, a.logprob) for a in t.top_logprobs]) for o in outs for t in o.tokens]
    return tokens, "".join(o.text for o in outs), outs[-1].finish_reason, outs[-1].completion_len


def _requests(max_new: int = 10) -> list[GenerationRequest]:
    stop = StoppingParams(max_new_tokens=max_new, ignore_eos=True)
    return [
        GenerationRequest("greedy", PROMPT, SamplingParams(), stop, logprobs=True, top_logprobs=3),
        GenerationRequest("seeded", PROMPT[:9], SamplingParams(temperature=0.8, seed=11), stop, logprobs=True),
        GenerationRequest(
            "penalized", PROMPT[3:], SamplingParams(temperature=0.9, top_p=0.9, repetition_penalty=1.2, seed=5), stop
        ),
    ]


def test_mtp_drafts_change_no_token_logprob_or_text_in_a_crowd(random_mtp: Path) -> None:
    """Each request alone without drafts, then all three at once with MTP drafts, then the greedy one again
    (its prompt from the prefix cache): bitwise the same."""
    plain = _engine(random_mtp, "ngram")
    alone = {r.request_id: _run(plain, [r])[0][r.request_id] for r in _requests()}
    fast = _engine(random_mtp, "mtp")
    assert len(fast.model.mtp) == 1
    crowd, _ = _run(fast, _requests())
    for rid, want in alone.items():
        assert _view(crowd[rid]) == _view(want), rid
    again, _ = _run(fast, _requests()[:1])
    assert _view(again["greedy"]) == _view(alone["greedy"])
    stats = fast.stats()
    assert stats.prefix_cache_hits > 0  # the second greedy run's prompt came from the cache
    assert stats.draft_tokens_proposed > 25  # random weights: drafts made, few kept
    assert 0 <= stats.draft_tokens_accepted < stats.draft_tokens_proposed


def test_an_mtp_layer_that_predicts_the_model_has_its_drafts_kept(predicting_mtp: Path) -> None:
    greedy = [
        GenerationRequest(
            "greedy", PROMPT, SamplingParams(), StoppingParams(max_new_tokens=24, ignore_eos=True), logprobs=True
        )
    ]
    want, plain_steps = _run(_engine(predicting_mtp, "ngram"), greedy)
    fast = _engine(predicting_mtp, "mtp")
    got, steps = _run(fast, greedy)
    assert _view(got["greedy"]) == _view(want["greedy"])
    stats = fast.stats()
    assert stats.draft_tokens_accepted >= 0.9 * stats.draft_tokens_proposed > 0
    # A prefill step, then up to 1 + 3 tokens a step instead of 1.
    assert plain_steps == 24 and steps <= 1 + 24 // 4 + 2


def _close(got: list[RequestOutput], want: list[RequestOutput]) -> None:
    """The same tokens and text, every logprob within 1e-4."""
    (ids, text, *_), (want_ids, want_text, *_) = _view(got), _view(want)
    assert [t for t, _, _ in ids] == [t for t, _, _ in want_ids] and text == want_text
    for (_, lp, top), (_, want_lp, want_top) in zip(ids, want_ids):
        assert lp is None or abs(lp - want_lp) < 1e-4
        assert [t for t, _ in top] == [t for t, _ in want_top]
        assert all(abs(a - b) < 1e-4 for (_, a), (_, b) in zip(top, want_top))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_two_tensor_parallel_ranks_draft_as_one_rank_and_change_no_token(random_mtp: Path, tmp_path: Path) -> None:
    """Two gloo ranks, started once, serving without drafts, with MTP drafts (rank 0 sends each pass of the
    MTP layer to rank 1 as it sends the steps), and with MTP drafts and ``--expert-parallel`` (each rank
    half the experts of the decoder's and the MTP block's layers): the three requests at once, then the
    greedy one again from the prefix cache. With drafts, the tokens, logprobs and text of the two ranks
    without, bit for bit; those of one rank within 1e-4; and after every step the same drafts as one rank
    drafts (rank 1's shard of the layer read the right hidden states and cache), so the same counts."""
    plain, mtp = _config("ngram"), _config("mtp")
    runs = {"plain": (plain, False), "mtp": (mtp, False), "mtp-ep": (mtp, True)}
    batches = [_requests(), _requests()[:1]]
    out = tmp_path / "results"
    run_ranks(replica_rank, (2, _free_port(), str(random_mtp), runs, batches, str(out)), 2)
    two: dict[str, tuple[list[Drafted], tuple[int, int]]] = torch.load(out, weights_only=False)
    one_plain, one_mtp = _engine(random_mtp, "ngram"), _engine(random_mtp, "mtp")
    for b, batch in enumerate(batches):
        want_outs, _ = run_drafting(one_plain, batch)
        _, want_drafts = run_drafting(one_mtp, batch)
        plain_outs = two["plain"][0][b][0]
        for run in ("mtp", "mtp-ep"):
            outs, drafts = two[run][0][b]
            assert drafts == want_drafts, run
            for r in batch:
                if run == "mtp":
                    assert _view(outs[r.request_id]) == _view(plain_outs[r.request_id]), r.request_id
                _close(outs[r.request_id], want_outs[r.request_id])
    stats = one_mtp.stats()
    assert two["mtp"][1] == two["mtp-ep"][1] == (stats.draft_tokens_proposed, stats.draft_tokens_accepted)
    assert stats.draft_tokens_proposed > 25


def test_an_fp8_mtp_layer_is_served_as_stored(random_mtp: Path, tmp_path: Path) -> None:
    """DeepSeek-V3's files hold the MTP layer's projections in FP8 blocks like the decoder's: multiplied as stored."""
    shutil.copytree(random_mtp, tmp_path, dirs_exist_ok=True)
    quantize_fp8(tmp_path, 32)
    fast = _engine(tmp_path, "mtp", quantization="fp8-block")
    plan = fast.model.plan
    assert {plan.quant_method(p).method for p in ("mtp.0.eh_proj", "mtp.0.block.self_attn.q_b_proj")} == {"fp8-block"}
    requests = _requests(max_new=8)[:1]
    want, _ = _run(_engine(tmp_path, "ngram", quantization="fp8-block"), requests)
    got, _ = _run(fast, requests)
    for rid in want:
        assert _view(got[rid]) == _view(want[rid]), rid
    assert fast.stats().draft_tokens_proposed > 0


def test_mtp_is_refused_where_the_checkpoint_has_no_mtp_layer(tmp_path: Path) -> None:
    deepseek_v3(q_lora=False).save_pretrained(tmp_path, safe_serialization=True)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    with pytest.raises(PlanRefused, match="has none"):
        load_model(tmp_path, speculative_method="mtp")
    # Declared (transformers' default) but not in the file: the missing tensors are named.
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    with pytest.raises(ModelLoadError, match="mtp.0.eh_proj"):
        load_model(tmp_path, speculative_method="mtp")
