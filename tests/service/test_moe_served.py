"""`tokenmill-server --model` a Mixtral Hugging Face directory with `--tensor-parallel 2 --expert-parallel`:
through the RPC, transformers' greedy tokens and prompt logprobs from two ranks holding two experts
each; a degree that does not divide the experts is refused at start (exit code 2)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.server_process import ServerProcess
from tests.tiny_checkpoint import write_byte_level_tokenizer
from tokenmill_client import Client

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

NEW_TOKENS = 8
FLAGS = ("--dtype", "float32", "--quantization", "none", "--drain-seconds", "1")


@pytest.fixture(scope="module")
def tiny_mixtral(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """Two layers of 4 experts (top-2), head_dim 64; a byte-level tokenizer of 256 bytes and 2 specials
    (a vocabulary of 258: two ranks split it evenly)."""
    directory = tmp_path_factory.mktemp("tiny-mixtral")
    write_byte_level_tokenizer(directory, "<|pad|>")
    config = transformers.MixtralConfig(
        vocab_size=258,
        hidden_size=128,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
    )
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config)
    with torch.no_grad():  # norms away from 1, sharper weights: no near-ties between tokens or experts
        for name, param in model.named_parameters():
            param.copy_(torch.randn_like(param) * 0.1 + 1.0 if "norm" in name else torch.randn_like(param) * 0.2)
    model.save_pretrained(directory, safe_serialization=True)
    return directory, model.eval()


@torch.inference_mode()
def test_two_expert_parallel_ranks_serve_transformers_tokens_and_prompt_logprobs(
    tiny_mixtral: tuple[Path, torch.nn.Module],
) -> None:
    directory, hf_model = tiny_mixtral
    server = ServerProcess("--model", str(directory), "--tensor-parallel", "2", "--expert-parallel", *FLAGS).start()
    try:
        with Client(server.address, timeout=120) as client:
            events = list(
                client.generate("Hello, Mixtral!", max_new_tokens=NEW_TOKENS, ignore_eos=True, prompt_logprobs=True)
            )
            plan = dict(client.model_info().load_plan)
    finally:
        server.stop()
    assert (plan["architecture"], plan["tensor_parallel"], plan["expert_parallel"]) == ("mixtral", "2", "true")

    prompt = events[0].prompt_tokens
    ids = [t.id for t in prompt]
    expected = list(ids)
    for _ in range(NEW_TOKENS):
        expected.append(int(hf_model(torch.tensor([expected])).logits[0, -1].argmax()))
    assert [t.id for e in events for t in e.tokens] == expected[len(ids) :]
    logprobs = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0], dim=-1)
    for row, token in enumerate(prompt[1:]):
        assert token.logprob is not None and abs(token.logprob - logprobs[row, token.id].item()) < 1e-4


def test_an_expert_parallel_degree_that_does_not_divide_the_experts_is_refused_at_start(
    tiny_mixtral: tuple[Path, torch.nn.Module], tmp_path: Path
) -> None:
    directory, _ = tiny_mixtral
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(directory / name, tmp_path / name)
    config = json.loads((directory / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_local_experts": 3}))
    server = ServerProcess("--model", str(tmp_path), "--tensor-parallel", "2", "--expert-parallel", *FLAGS)
    with pytest.raises(RuntimeError, match="exited with 2") as excinfo:
        server.start()
    assert "3 experts (--expert-parallel gives each rank whole experts)" in str(excinfo.value)
    assert "degrees that work: 1" in str(excinfo.value)
