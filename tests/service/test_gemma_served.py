"""`tokenmill-server --model` a Gemma 2 Hugging Face directory: through the RPC, over a prompt of four
sliding windows and more, transformers' greedy tokens and prompt logprobs (windows and soft caps
served by the native attention kernel), every layer in the native decoder stack, as the load plan says."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.engine.gemma_checkpoints import WINDOW
from tests.served_family import FLOAT32, assert_transformers_tokens_and_prompt_logprobs, serve_greedy
from tests.tiny_checkpoint import sharpen, write_byte_level_tokenizer

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

PROMPT = "Hello, Gemma 2! A window of eight tokens slides."  # one token per byte: six windows


@pytest.fixture(scope="module")
def tiny_gemma2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """Two layers (0 local, 1 global), tied head; a byte-level tokenizer of 256 bytes + EOS."""
    directory = tmp_path_factory.mktemp("tiny-gemma2")
    write_byte_level_tokenizer(directory)
    config = transformers.Gemma2Config(
        vocab_size=257,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=512,
        sliding_window=WINDOW,
        query_pre_attn_scalar=48,
        attn_logit_softcapping=10.0,
        final_logit_softcapping=8.0,
    )
    torch.manual_seed(0)
    model = sharpen(transformers.Gemma2ForCausalLM(config), norm_center=0.0)  # Gemma multiplies by 1 + w
    model.save_pretrained(directory, safe_serialization=True)
    return directory, model


def test_a_served_gemma2_gives_transformers_tokens_and_prompt_logprobs(
    tiny_gemma2: tuple[Path, torch.nn.Module],
) -> None:
    directory, hf_model = tiny_gemma2
    served = serve_greedy(directory, PROMPT, *FLOAT32)
    assert served.plan["architecture"] == "gemma2"
    executor = served.plan["executor"]
    assert executor.startswith("native-stack ("), executor
    assert len(served.events[0].prompt_tokens) > 4 * WINDOW
    assert_transformers_tokens_and_prompt_logprobs(hf_model, served)
