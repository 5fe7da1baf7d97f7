"""`tokenmill-server --model` a Qwen3 Hugging Face directory: through the RPC, transformers' greedy
tokens and prompt logprobs, and a load plan that says why the layers run one by one; the same with
`--backend triton` (its interpreter, TRITON_INTERPRET=1, on a CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.served_family import FLOAT32, assert_transformers_tokens_and_prompt_logprobs, serve_greedy
from tests.tiny_checkpoint import sharpen, write_byte_level_tokenizer

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """Two layers, head_dim 64 (hidden / heads is 32), tied head; a byte-level tokenizer of 256 bytes + EOS."""
    directory = tmp_path_factory.mktemp("tiny-qwen3")
    write_byte_level_tokenizer(directory)
    config = transformers.Qwen3Config(
        vocab_size=257,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = sharpen(transformers.Qwen3ForCausalLM(config))  # q_norm and k_norm away from 1 too
    model.save_pretrained(directory, safe_serialization=True)
    return directory, model


def test_a_served_qwen3_gives_transformers_tokens_and_prompt_logprobs(
    tiny_qwen3: tuple[Path, torch.nn.Module],
) -> None:
    directory, hf_model = tiny_qwen3
    served = serve_greedy(directory, "Hello, Qwen3!", *FLOAT32)
    assert served.plan["architecture"] == "qwen3"
    executor = served.plan["executor"]
    assert executor.startswith("native-stack ("), executor  # the per-head q/k norms in its one native call
    assert_transformers_tokens_and_prompt_logprobs(hf_model, served)


def test_a_qwen3_served_by_triton_in_the_interpreter_gives_transformers_tokens_and_prompt_logprobs(
    tiny_qwen3: tuple[Path, torch.nn.Module],
) -> None:
    directory, hf_model = tiny_qwen3
    served = serve_greedy(directory, "Qwen3, triton", "--backend", "triton", *FLOAT32, env={"TRITON_INTERPRET": "1"})
    assert served.backend == "triton" and served.plan["architecture"] == "qwen3"
    assert_transformers_tokens_and_prompt_logprobs(hf_model, served)
