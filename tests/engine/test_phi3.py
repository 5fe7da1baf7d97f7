"""Phi-3 / Phi-4-mini: tiny random transformers checkpoints (fused qkv_proj and gate_up_proj in the
file) with whole-head rotary untied and a sliding window of 16 tokens on every layer (under a 40-token
prompt), partial rotary tied (Phi-4-mini's shape), and partial rotary with LongRoPE (a 32-token original
context under the 40-token prompt), served as transformers computes them: logits and prompt logprobs
within 1e-4 (float32, dense) on each ops backend (native CPU ops, the torch reference, triton), the same
greedy tokens, the same from a GGUF of each as llama.cpp's converter writes it, a prompt bitwise the same
alone and in a batch; LongRoPE's long factors served past the original context and its short ones within
it, as the load plan says; the fused split shown to matter, and what is not served refused or capped.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from tests.engine.family_checks import assert_greedy_matches, assert_prompt_matches, hf_logits, load
from tests.engine.granite_phi3_checkpoints import LONGROPE, ORIGINAL, ROTARY_DIM, VARIANTS, WINDOW, phi3
from tests.engine.granite_phi3_checkpoints import PHI3_TINY as TINY
from tests.engine.invariance import assert_alone_equals_crowd, assert_prefill_equals_decode
from tests.engine.test_gguf_loader import convert_hf_to_gguf
from tokenmill_service.worker.engine.executor import make_executor
from tokenmill_service.worker.engine.model_runner import forward_prompt
from tokenmill_service.worker.loader import load_model
from tokenmill_service.worker.models import registry
from tokenmill_service.worker.models.config import layer_window
from tokenmill_service.worker.models.hf_loader import HFCheckpointError, read_hf_config
from tokenmill_service.worker.models.phi3 import LONG, PHI3, SHORT

transformers = pytest.importorskip("transformers")

PROMPT = torch.randint(0, TINY["vocab_size"], (40,), generator=torch.Generator().manual_seed(2)).tolist()


def longrope(hf_model: Any) -> bool:
    return bool(hf_model.config.rope_parameters.get("rope_type") == "longrope")


def greedy_prompt(hf_model: Any) -> list[int]:
    """A prompt for greedy decoding: with LongRoPE, past the original context from its first step (where
    transformers, too, takes the long factors for every position)."""
    return PROMPT[: ORIGINAL + 1] if longrope(hf_model) else PROMPT[:12]


@pytest.fixture(scope="module", params=list(VARIANTS))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """A saved tiny Phi-3 and the transformers model it was saved from."""
    hf_model = phi3(request.param)
    directory = tmp_path_factory.mktemp("tiny-phi3")
    hf_model.save_pretrained(directory, safe_serialization=True)
    return directory, hf_model


def test_the_checkpoint_holds_fused_tensors(checkpoint: tuple[Path, Any]) -> None:
    """What the loader is asked to split: transformers saves q/k/v and gate/up each as one tensor."""
    names = set(checkpoint[1].state_dict())
    assert "model.layers.0.self_attn.qkv_proj.weight" in names and "model.layers.0.mlp.gate_up_proj.weight" in names
    assert not any(name.endswith(("q_proj.weight", "gate_proj.weight")) for name in names)


@pytest.mark.parametrize("ops", ["native", "torch", "triton"])
@torch.inference_mode()
def test_logits_and_prompt_logprobs_are_the_transformers_ones(checkpoint: tuple[Path, Any], ops: str) -> None:
    directory, hf_model = checkpoint
    model = load(directory, ops)
    assert model.config.architecture == "phi3"
    assert_prompt_matches(model, hf_model, PROMPT)


def test_the_config_carries_rotary_and_longrope(checkpoint: tuple[Path, Any]) -> None:
    directory, hf_model = checkpoint
    config = read_hf_config(directory)
    assert config.architecture == "phi3" and config.tie_word_embeddings is hf_model.config.tie_word_embeddings
    partial = hf_model.config.rope_parameters.get("partial_rotary_factor", 1.0) < 1.0
    assert config.extra["rotary_dim"] == (ROTARY_DIM if partial else 64)
    if longrope(hf_model):
        assert config.extra["rope_short_factor"] == LONGROPE["short_factor"]
        assert config.extra["rope_long_factor"] == LONGROPE["long_factor"]
        assert config.extra["rope_original_max_positions"] == ORIGINAL
        scale = 256 / ORIGINAL
        assert config.extra["rope_attention_factor"] == pytest.approx(math.sqrt(1 + math.log(scale) / math.log(32)))
        assert config.max_position_embeddings == 256  # the plan chooses the factors; the context is whole
    else:
        assert "rope_short_factor" not in config.extra and config.max_position_embeddings == 256
    # A sliding window applies to every layer and leaves the context whole.
    windows = [layer_window(config, i) for i in range(2)]
    assert windows == ([WINDOW, WINDOW] if hf_model.config.sliding_window else [None, None])


def _swap(pieces: list[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    """The first two pieces' rows exchanged (q <-> k where they are the same size, gate <-> up)."""
    (a, a_start, a_rows), (b, b_start, b_rows), *rest = pieces
    return [(a, b_start, b_rows), (b, a_start, a_rows), *rest]


@pytest.mark.parametrize("fused", ["qkv_proj", "gate_up_proj"])
@torch.inference_mode()
def test_a_wrong_fused_split_is_far_from_transformers(
    checkpoint: tuple[Path, Any], fused: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Guards the comparison above: rows cut from the fused tensors in another order load (the shapes fit)
    but give other logits. For q/k/v the k and v pieces swap (same size under grouped-query attention)."""
    directory, hf_model = checkpoint
    real = PHI3.tensors.unfuse

    def wrong(name: str, config: Any) -> list[tuple[str, int, int]] | None:
        pieces = real(name, config)
        if pieces is None or fused not in name:
            return pieces
        return [pieces[0], *_swap(pieces[1:])] if fused == "qkv_proj" else _swap(pieces)

    wrong_spec = dataclasses.replace(PHI3, tensors=dataclasses.replace(PHI3.tensors, unfuse=wrong))
    monkeypatch.setitem(registry._FAMILIES, "phi3", wrong_spec)
    model = load_model(directory)
    actual = model.compute_logits(forward_prompt(model, PROMPT))
    assert (actual - hf_logits(hf_model, PROMPT)).abs().max() > 1e-2


def test_unfuse_names_the_rows_of_each_piece(checkpoint: tuple[Path, Any]) -> None:
    config = read_hf_config(checkpoint[0])
    q, kv, inter = 4 * 64, 2 * 64, 128
    assert PHI3.tensors.unfuse("model.layers.1.self_attn.qkv_proj.weight", config) == [
        ("model.layers.1.self_attn.q_proj.weight", 0, q),
        ("model.layers.1.self_attn.k_proj.weight", q, kv),
        ("model.layers.1.self_attn.v_proj.weight", q + kv, kv),
    ]
    assert PHI3.tensors.unfuse("model.layers.0.mlp.gate_up_proj.weight", config) == [
        ("model.layers.0.mlp.gate_proj.weight", 0, inter),
        ("model.layers.0.mlp.up_proj.weight", inter, inter),
    ]
    assert PHI3.tensors.unfuse("model.layers.0.self_attn.o_proj.weight", config) is None


def test_the_plan_runs_the_native_stack_with_partial_rotary(checkpoint: tuple[Path, Any]) -> None:
    """The logits test above runs it (the plan's executor); tests/kernels/test_decoder_stack.py holds its bits
    to the eager loop's."""
    directory, hf_model = checkpoint
    model = load(directory, "native")
    assert model.plan.executor.value == "native-stack", model.plan.executor
    stack = make_executor(model).stack.spec  # type: ignore[attr-defined]
    partial = hf_model.config.rope_parameters["partial_rotary_factor"] < 1
    assert stack.rotary_dim == (ROTARY_DIM if partial else TINY["hidden_size"] // TINY["num_attention_heads"])


def test_greedy_tokens_are_the_transformers_ones(checkpoint: tuple[Path, Any]) -> None:
    directory, hf_model = checkpoint
    assert_greedy_matches(load(directory, "native"), hf_model, greedy_prompt(hf_model), 10)


@pytest.mark.parametrize("ops", ["native", "torch"])
def test_a_prompt_is_bitwise_the_same_alone_and_in_a_batch(checkpoint: tuple[Path, Any], ops: str) -> None:
    """Prefill and the next decode step, alone and between two other sequences (block tables out of order);
    with a window, a 26-token prompt (past the window) prefilled whole or 5 then decoded, the same bits."""
    directory, hf_model = checkpoint
    model = load(directory, ops)
    assert_alone_equals_crowd(model, PROMPT)
    if hf_model.config.sliding_window:
        assert_prefill_equals_decode(model, PROMPT[:26], prefilled=5)


def _edited(directory: Path, tmp_path: Path, edit: dict[str, Any]) -> Path:
    """A copy of the checkpoint's config.json with ``edit`` applied (weights not needed to read it)."""
    raw = json.loads((directory / "config.json").read_text())
    raw.update(edit)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return tmp_path


def phi3_gguf_metadata(hf_model: Any) -> Any:
    """What llama.cpp's converter (Phi3MiniModel) adds to the common keys: the sliding window (0: none),
    the original context, and for LongRoPE the attention factor and the factors as tensors."""
    cfg, rope = hf_model.config, hf_model.config.rope_parameters

    def write(writer: gguf.GGUFWriter) -> None:
        writer.add_sliding_window(cfg.sliding_window or 0)
        original = rope.get("original_max_position_embeddings", cfg.max_position_embeddings)
        writer.add_rope_scaling_orig_ctx_len(original)
        if rope.get("long_factor"):
            scale = cfg.max_position_embeddings / original
            writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
            writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
            writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))

    return write


@torch.inference_mode()
def test_a_gguf_of_the_model_gives_the_same_logits_and_greedy_tokens(
    checkpoint: tuple[Path, Any], tmp_path: Path
) -> None:
    """llama.cpp's phi3 GGUF: fused attn_qkv and ffn_up (gate and up) split by the loader, rotary dims from
    rope.dimension_count, the LongRoPE factors from their tensors, the window from its key."""
    directory, hf_model = checkpoint
    path = tmp_path / "tiny-phi3.gguf"
    convert_hf_to_gguf(hf_model, "phi3", path, metadata=phi3_gguf_metadata(hf_model))
    names = {t.name for t in gguf.GGUFReader(path).tensors}
    assert "blk.0.attn_qkv.weight" in names and "blk.0.ffn_gate.weight" not in names
    model = load_model(path, dtype=torch.float32, quantization="none")
    assert model.config.architecture == "phi3"
    assert model.config.extra["rotary_dim"] == read_hf_config(directory).extra["rotary_dim"]
    assert model.config.max_position_embeddings == read_hf_config(directory).max_position_embeddings
    assert [layer.self_attn.params.window for layer in model.model.layers] == [hf_model.config.sliding_window] * 2
    assert_prompt_matches(model, hf_model, PROMPT)
    assert_greedy_matches(model, hf_model, greedy_prompt(hf_model), 6)
    if longrope(hf_model):  # rope_factors_long served past the original context, the short ones within it
        assert model.plan.rope.value == LONG
        short = load_model(path, dtype=torch.float32, quantization="none", max_model_len=ORIGINAL)
        assert short.plan.rope.value == SHORT and short.max_positions == ORIGINAL
        assert_prompt_matches(short, hf_model, PROMPT[:ORIGINAL])


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "RoPE scaling type 'dynamic' is not supported"),
        ({"rope_parameters": {**LONGROPE, "short_factor": [1.0, 2.0]}}, "short_factor has 2 values"),
        (
            {"partial_rotary_factor": 0.5, "rope_parameters": {**LONGROPE, "long_factor": [1.0] * 17}},
            "long_factor has 17 values",
        ),
        ({"partial_rotary_factor": 0.3, "rope_parameters": None}, "partial_rotary_factor 0.3 gives 19 rotary dims"),
    ],
)
def test_what_is_not_served_is_refused(checkpoint: tuple[Path, Any], tmp_path: Path, edit: Any, message: str) -> None:
    with pytest.raises(HFCheckpointError, match=message):
        read_hf_config(_edited(checkpoint[0], tmp_path, edit))


@torch.inference_mode()
def test_the_served_context_chooses_longrope_factors_in_the_plan(checkpoint: tuple[Path, Any]) -> None:
    """As llama.cpp: a served context past the original length takes the long factors for every position
    (the logits test above: transformers' over the 40-token prompt); within it the short factors, the
    context capped there, and transformers' numbers over a prompt as long as the original. The plan's
    ``rope`` entry says which and why; a family without LongRoPE has none."""
    directory, hf_model = checkpoint
    served_whole = load_model(directory)
    if not longrope(hf_model):
        assert served_whole.plan.rope is None and "rope" not in served_whole.plan.summary()
        return
    rope = served_whole.plan.summary()["rope"]
    assert rope.startswith(f"{LONG} (LongRoPE: the served context (the model's own: 256) exceeds the original 32")
    assert served_whole.max_positions == 256
    config = read_hf_config(directory)
    assert PHI3.rope_choice is not None
    chosen = PHI3.rope_choice(config, ORIGINAL + 1)
    assert chosen is not None and chosen[0] == LONG
    short = load_model(directory, max_model_len=ORIGINAL)
    assert short.plan.summary()["rope"].startswith(f"{SHORT} (LongRoPE: the served context (--max-model-len 32: 32)")
    assert short.max_positions == ORIGINAL
    assert_prompt_matches(short, hf_model, PROMPT[:ORIGINAL])
    # The choice matters: over a prompt within the original context (short factors in transformers), the
    # long factors give other logits.
    within = PROMPT[:ORIGINAL]
    long_logits = served_whole.compute_logits(forward_prompt(served_whole, within))
    assert (long_logits - hf_logits(hf_model, within)).abs().max() > 1e-2
