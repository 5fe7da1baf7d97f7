"""`tokenmill-server --model` a DeepSeek-V3 Hugging Face directory (a dense first layer, then routed and
shared experts): through the RPC, transformers' greedy tokens and prompt logprobs, GetModelInfo's latent
cache and its bytes per token; and a checkpoint routing by softmax (DeepSeek-V2's way) stops the server
with exit code 2, saying why."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from tests.served_family import FLOAT32, assert_transformers_tokens_and_prompt_logprobs, serve_greedy
from tests.server_process import SERVER, free_port
from tests.tiny_checkpoint import write_byte_level_tokenizer
from tests.tiny_deepseek import deepseek_v3

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def tiny_deepseek(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """Three layers (the first dense, then 8 routed experts and a shared one) with q_lora, YaRN and
    interleaved rope; a byte-level tokenizer of 256 bytes + EOS."""
    directory = tmp_path_factory.mktemp("tiny-deepseek")
    write_byte_level_tokenizer(directory)
    model = deepseek_v3(q_lora=True, vocab_size=257, moe=True)
    model.save_pretrained(directory, safe_serialization=True)
    return directory, model


def test_a_served_deepseek_v3_gives_transformers_tokens_and_prompt_logprobs(
    tiny_deepseek: tuple[Path, torch.nn.Module],
) -> None:
    directory, hf_model = tiny_deepseek
    served = serve_greedy(directory, "Hello, DeepSeek!", *FLOAT32)
    plan = served.plan
    assert plan["architecture"] == "deepseek_v3" and plan["kv_cache_layout"] == "latent blocks"
    # 3 layers x (64 latent + 64 rotary key) float32 values, against 4 heads x (96 + 32) per layer.
    assert plan["kv_cache_bytes_per_token"].startswith("1536 (") and "(4.0x)" in plan["kv_cache_bytes_per_token"]
    assert plan["linear_layers"] == "none/block_gemm-f32: 56"  # the experts' projections among the layers
    assert_transformers_tokens_and_prompt_logprobs(hf_model, served)


def test_softmax_routing_stops_the_server_with_exit_code_2(
    tiny_deepseek: tuple[Path, torch.nn.Module], tmp_path: Path
) -> None:
    directory = tmp_path / "moe"
    directory.mkdir()
    for file in tiny_deepseek[0].iterdir():
        (directory / file.name).symlink_to(file)
    (directory / "config.json").unlink()
    config = json.loads((tiny_deepseek[0] / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "scoring_func": "softmax"}))
    command = [str(SERVER), "--model", str(directory), "--port", str(free_port()), "--http-port", str(free_port())]
    result = subprocess.run(
        [*command, "--log-format", "json"], check=False, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "tokenmill-server: error:" in result.stderr
    assert "routes its experts by softmax scores; only DeepSeek-V3's sigmoid routing" in result.stderr
