"""``tokenmill-bench shaped``: GGUFs of real models' shapes with random weights, which tokenmill (and
llama.cpp) load as they would the real file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tokenmill_bench import shaped
from tokenmill_service.contract.plan import LoadOptions
from tokenmill_service.contract.tokenizer import load_tokenizer
from tokenmill_service.worker.engine.model_runner import forward_prompt
from tokenmill_service.worker.loader import load


@pytest.mark.parametrize("architecture", ["llama", "qwen2", "mixtral"])
def test_a_shaped_gguf_loads_with_its_tokenizer_and_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, architecture: str
) -> None:
    # The real shapes are gigabytes: the same writer, at a shape of a few megabytes.
    experts = {"experts": 4, "experts_used": 2} if architecture == "mixtral" else {}
    gguf_arch = "llama" if architecture == "mixtral" else architecture  # Mixtral-style: llama with experts
    tiny = shaped.Shape(gguf_arch, 256, 2, 4, 2, 512, 50000, 10000.0, tied=architecture == "qwen2", **experts)
    monkeypatch.setitem(shaped.SHAPES, "tiny", dataclass_replace(tiny, qkv_bias=architecture == "qwen2"))
    path = shaped.write_shaped_gguf("tiny", tmp_path / "tiny.gguf")
    tokenizer = load_tokenizer(path)
    assert tokenizer.vocab_size == 50000  # the default model's 49152 tokens, padded with unused ones
    assert tokenizer.decode(tokenizer.encode("Hello, world")) == "Hello, world"
    model = load(LoadOptions(model=str(path)))
    assert model.config.architecture == architecture and model.config.num_layers == 2
    assert model.config.tie_word_embeddings is tiny.tied
    with torch.inference_mode():
        logits = model.compute_logits(forward_prompt(model, tokenizer.encode("Hello")))
    assert logits.shape[-1] == 50000 and torch.isfinite(logits).all()


def dataclass_replace(shape: shaped.Shape, **changes: object) -> shaped.Shape:
    import dataclasses

    return dataclasses.replace(shape, **changes)  # type: ignore[arg-type]


def test_the_command_names_the_shapes_and_says_what_fails(tmp_path: Path) -> None:
    bench = Path(sys.executable).parent / "tokenmill-bench"
    out = subprocess.run([str(bench), "shaped", "--help"], capture_output=True, text=True, check=False, timeout=60)
    assert out.returncode == 0 and all(name in out.stdout for name in shaped.SHAPES)
    missing = tmp_path / "no-such-llama-quantize"
    failed = subprocess.run(
        [
            str(bench),
            "shaped",
            "llama-3.2-1b",
            str(tmp_path / "x.gguf"),
            "--type",
            "Q4_K_M",
            "--llama-quantize",
            str(missing),
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    assert failed.returncode == 2 and "tokenmill-bench shaped: error:" in failed.stderr
