"""The default model (SmolLM2-135M-Instruct, GGUF Q4_1) reproduces reference prompt logprobs.

The reference (tests/data/smollm2_reference.json) holds, for each prompt, the logprob of every
next token and the top 5 alternatives, computed independently from the same GGUF file.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from tokenmill_service.worker.engine.model_runner import forward_prompt
from tokenmill_service.worker.loader import load_model, resolve_model_path
from tokenmill_service.worker.models.decoder import DecoderForCausalLM

REFERENCE = Path(__file__).parents[1] / "data" / "smollm2_reference.json"
LOGPROB_ATOL = 1e-3
# Two reference candidates this close may come out in either order at float32 precision.
NEAR_TIE = 1e-3


@pytest.fixture(scope="module")
def prompts() -> list[dict[str, Any]]:
    data: list[dict[str, Any]] = json.loads(REFERENCE.read_text())["prompt_logprobs"]
    return data


@pytest.fixture(scope="module")
def model_f32(default_model: DecoderForCausalLM) -> DecoderForCausalLM:
    # The session's shared float32 load (conftest.py), so the suite loads the model once.
    assert default_model.act_dtype == torch.float32 and default_model.quantization == "none"
    return default_model


def prompt_logprobs(model: DecoderForCausalLM, ids: list[int]) -> torch.Tensor:
    """Log-softmax over the vocabulary at each prompt position, one no-cache pass: [T, vocab]."""
    with torch.inference_mode():
        return torch.log_softmax(model.compute_logits(forward_prompt(model, ids)), dim=-1)


def _tolerated_top5_difference(ours: list[int], ref_top: list[list[float]], logprobs: torch.Tensor) -> bool:
    """True when every rank where the ids differ holds reference candidates that are near-tied.

    A rank counts as near-tied when the reference logprob there is within NEAR_TIE of a
    neighbouring rank's, or (for rank 5) of our fifth candidate, which the reference ranks sixth.
    """
    ref_ids = [int(i) for i, _ in ref_top]
    ref_lps = [lp for _, lp in ref_top]
    for rank, (mine, theirs) in enumerate(zip(ours, ref_ids, strict=True)):
        if mine == theirs:
            continue
        neighbours = [ref_lps[r] for r in (rank - 1, rank + 1) if 0 <= r < len(ref_lps)]
        if rank == len(ref_lps) - 1:
            neighbours.append(float(logprobs[mine]))
        if not any(abs(ref_lps[rank] - n) <= NEAR_TIE for n in neighbours):
            return False
    return True


def test_float32_prompt_logprobs_match_the_reference(
    model_f32: DecoderForCausalLM, prompts: list[dict[str, Any]]
) -> None:
    max_error = 0.0
    tolerated: list[str] = []
    for prompt in prompts:
        ids = prompt["ids"]
        logprobs = prompt_logprobs(model_f32, ids)
        assert len(prompt["positions"]) == len(ids) - 1
        for i, expected in enumerate(prompt["positions"]):
            row = logprobs[i]
            assert expected["token"] == ids[i + 1]
            # The realised token and every reference top-5 candidate, by id.
            pairs = [(expected["token"], expected["logprob"]), *((int(t), lp) for t, lp in expected["top"])]
            for token, ref_logprob in pairs:
                error = abs(float(row[token]) - ref_logprob)
                max_error = max(max_error, error)
                assert error <= LOGPROB_ATOL, (prompt["text"], i, token, float(row[token]), ref_logprob)

            ours = row.topk(5).indices.tolist()
            ref_ids = [int(t) for t, _ in expected["top"]]
            if ours != ref_ids:
                assert _tolerated_top5_difference(ours, expected["top"], row), (prompt["text"], i, ours, ref_ids)
                tolerated.append(f"{prompt['text']!r} position {i}: ours {ours} vs reference {ref_ids}")
    for note in tolerated:
        warnings.warn(f"tolerated a near-tie (within {NEAR_TIE}) reordering of the top 5: {note}", stacklevel=1)
    assert max_error <= LOGPROB_ATOL


def test_bfloat16_model_roughly_agrees_with_the_reference(prompts: list[dict[str, Any]]) -> None:
    model = load_model(resolve_model_path(None), dtype=torch.bfloat16)
    assert model.act_dtype == torch.bfloat16
    agree = total = 0
    for prompt in prompts:
        logprobs = prompt_logprobs(model, prompt["ids"])
        for i, expected in enumerate(prompt["positions"]):
            row = logprobs[i]
            # bfloat16 logits near 16 are spaced 0.125 apart: a loose bound, not float32's.
            assert abs(float(row[expected["token"]]) - expected["logprob"]) < 0.5
            (best, best_lp), (_, second_lp) = expected["top"][0], expected["top"][1]
            top1 = int(row.argmax())
            if best_lp - second_lp > 0.25:  # a clear winner must stay the winner
                assert top1 == int(best), (prompt["text"], i)
            agree += top1 == int(best)
            total += 1
    assert agree / total >= 0.95


def test_default_model_is_configured_as_smollm2(model_f32: DecoderForCausalLM) -> None:
    config = model_f32.config
    assert config.name == "SmolLM2-135M-Instruct.Q4_1"
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (30, 576, 9, 3)
    assert (config.vocab_size, config.max_position_embeddings, config.rope_theta) == (49152, 8192, 100000.0)
    head = model_f32.lm_head.quant.dequantized(model_f32.lm_head)
    assert config.tie_word_embeddings and torch.equal(head, model_f32.model.embed_tokens.weight)
    assert not model_f32.training
    assert not any(p.requires_grad for p in model_f32.parameters())


def test_top5_comparison_tolerates_only_near_tied_swaps() -> None:
    logprobs = torch.full((8,), -9.0)
    reference = [[0, -1.0], [1, -2.0], [2, -2.0005], [3, -3.0], [4, -4.0]]
    assert _tolerated_top5_difference([0, 2, 1, 3, 4], reference, logprobs)
    assert not _tolerated_top5_difference([1, 0, 2, 3, 4], reference, logprobs)
    # Rank 5 against the candidate the reference ranked sixth.
    logprobs[7] = -4.0004
    assert _tolerated_top5_difference([0, 1, 2, 3, 7], reference, logprobs)
    logprobs[7] = -3.9
    assert not _tolerated_top5_difference([0, 1, 2, 3, 7], reference, logprobs)
