"""`tokenmill-server --model` a Mixtral Hugging Face directory with `--tensor-parallel 2 --expert-parallel`:
through the RPC, transformers' greedy tokens and prompt logprobs from two ranks holding two experts
each; a degree that does not divide the experts is refused at start (exit code 2)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.served_family import FLOAT32, assert_transformers_tokens_and_prompt_logprobs, serve_greedy
from tests.server_process import ServerProcess
from tests.tiny_checkpoint import sharpen, write_byte_level_tokenizer

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

FLAGS = FLOAT32


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
    model = sharpen(transformers.MixtralForCausalLM(config))  # no near-ties between tokens or experts
    model.save_pretrained(directory, safe_serialization=True)
    return directory, model


def test_two_expert_parallel_ranks_serve_transformers_tokens_and_prompt_logprobs(
    tiny_mixtral: tuple[Path, torch.nn.Module],
) -> None:
    directory, hf_model = tiny_mixtral
    served = serve_greedy(directory, "Hello, Mixtral!", "--tensor-parallel", "2", "--expert-parallel", *FLAGS)
    plan = served.plan
    assert (plan["architecture"], plan["tensor_parallel"], plan["expert_parallel"]) == ("mixtral", "2", "true")
    assert_transformers_tokens_and_prompt_logprobs(hf_model, served)


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
