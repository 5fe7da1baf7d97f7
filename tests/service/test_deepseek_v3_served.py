"""`tokenmill-server --model` a DeepSeek-V3 Hugging Face directory (a dense first layer, then routed and
shared experts, and a random multi-token-prediction layer, left aside by default): through the RPC,
transformers' greedy tokens and prompt logprobs, GetModelInfo's latent cache and its bytes per token;
with `--speculative-method mtp` the same tokens and logprobs bit for bit (greedy and seeded) and the
drafts counted in GetModelInfo; and a checkpoint routing by softmax (DeepSeek-V2's way) stops the server
with exit code 2, saying why."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from tests.server_process import SERVER, ServerProcess, free_port
from tests.tiny_checkpoint import write_byte_level_tokenizer
from tests.tiny_deepseek import add_mtp_layer, deepseek_v3
from tokenmill_client import Client, GenerateEvent, ModelInfo

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

NEW_TOKENS = 8


@pytest.fixture(scope="module")
def tiny_deepseek(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """Three layers (the first dense, then 8 routed experts and a shared one) with q_lora, YaRN and
    interleaved rope, a random MTP layer; a byte-level tokenizer of 256 bytes + EOS."""
    directory = tmp_path_factory.mktemp("tiny-deepseek")
    write_byte_level_tokenizer(directory)
    model = deepseek_v3(q_lora=True, vocab_size=257, moe=True)
    model.save_pretrained(directory, safe_serialization=True)
    add_mtp_layer(directory)
    return directory, model


Served = tuple[list[list[GenerateEvent]], ModelInfo]


def serve(directory: Path, *flags: str) -> Served:
    """A greedy request (logprobs of the prompt and the tokens) and a seeded one, and GetModelInfo after."""
    args = ("--model", str(directory), "--dtype", "float32", "--quantization", "none", "--drain-seconds", "1")
    server = ServerProcess(*args, *flags).start()
    try:
        with Client(server.address, timeout=120) as client:
            runs = [
                list(client.generate("Hello, DeepSeek!", max_new_tokens=NEW_TOKENS, ignore_eos=True, **options))
                for options in (
                    {"prompt_logprobs": True, "top_logprobs": 2},
                    {"temperature": 0.8, "seed": 3, "logprobs": True},
                )
            ]
            return runs, client.model_info()
    finally:
        server.stop()


@pytest.fixture(scope="module")
def served_default(tiny_deepseek: tuple[Path, torch.nn.Module]) -> Served:
    return serve(tiny_deepseek[0])


@torch.inference_mode()
def test_a_served_deepseek_v3_gives_transformers_tokens_and_prompt_logprobs(
    tiny_deepseek: tuple[Path, torch.nn.Module], served_default: Served
) -> None:
    hf_model = tiny_deepseek[1]
    (events, _), info = served_default
    plan = dict(info.load_plan)
    assert plan["architecture"] == "deepseek_v3" and plan["kv_cache_layout"] == "latent blocks"
    # 3 layers x (64 latent + 64 rotary key) float32 values, against 4 heads x (96 + 32) per layer.
    assert plan["kv_cache_bytes_per_token"].startswith("1536 (") and "(4.0x)" in plan["kv_cache_bytes_per_token"]
    assert plan["linear_layers"] == "none/block_gemm-f32: 56"  # the experts' projections among the layers

    prompt = events[0].prompt_tokens
    ids = [t.id for t in prompt]
    expected = list(ids)
    for _ in range(NEW_TOKENS):
        expected.append(int(hf_model(torch.tensor([expected])).logits[0, -1].argmax()))
    assert [t.id for e in events for t in e.tokens] == expected[len(ids) :]
    logprobs = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0], dim=-1)
    for row, token in enumerate(prompt[1:]):
        assert token.logprob is not None and abs(token.logprob - logprobs[row, token.id].item()) < 1e-4


def test_mtp_drafts_change_no_token_or_logprob_of_a_served_deepseek_v3(
    tiny_deepseek: tuple[Path, torch.nn.Module], served_default: Served
) -> None:
    runs, info = serve(tiny_deepseek[0], "--speculative-method", "mtp", "--speculative-tokens", "2")

    def view(events: list[GenerateEvent]) -> list[tuple[int, float | None, list[tuple[int, float]]]]:
        return [(t.id, t.logprob, [(a.id, a.logprob) for a in t.top_logprobs]) for e in events for t in e.tokens]

    for got, want in zip(runs, served_default[0]):
        assert view(got) == view(want)
    assert [t.logprob for t in runs[0][0].prompt_tokens] == [t.logprob for t in served_default[0][0][0].prompt_tokens]
    plan = dict(info.load_plan)
    assert plan["speculative_method"].startswith("mtp (")
    # One more layer's latent and rotary key: the MTP layer's block.
    assert plan["kv_cache_bytes_per_token"].startswith("2048 (")
    assert info.engine.draft_tokens_proposed > 0  # random weights: few or none kept
    assert 0 <= info.engine.draft_tokens_accepted <= info.engine.draft_tokens_proposed


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
