"""`tokenmill-server --model` a Phi-3 directory with LongRoPE (a 32-token original context) and
`--max-model-len 64`: the flag reaches the worker's load plan, whose `rope` entry in GetModelInfo says the
long factors serve every position, and through the RPC a 40-token prompt's logprobs and the greedy tokens
after it are transformers' (whose forward pass over a sequence past the original takes the long factors)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.served_family import FLOAT32, assert_transformers_tokens_and_prompt_logprobs, serve_greedy
from tests.tiny_checkpoint import sharpen, write_byte_level_tokenizer

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

ORIGINAL = 32
ROTARY_HALF = 16  # partial_rotary_factor 0.5 of a 64 head: 32 rotary dims, 16 factors
PROMPT = "LongRoPE past its original context, here."  # 41 bytes: 41 tokens of a byte-level vocabulary


@pytest.fixture(scope="module")
def tiny_phi3_longrope(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    directory = tmp_path_factory.mktemp("tiny-phi3-longrope")
    write_byte_level_tokenizer(directory)
    config = transformers.Phi3Config(
        vocab_size=257,
        hidden_size=128,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        original_max_position_embeddings=ORIGINAL,
        partial_rotary_factor=0.5,
        rope_scaling={
            "rope_type": "longrope",
            "short_factor": [1.0 + i / 8 for i in range(ROTARY_HALF)],
            "long_factor": [4.0 + i for i in range(ROTARY_HALF)],
            "original_max_position_embeddings": ORIGINAL,
        },
        rms_norm_eps=1e-5,
        bos_token_id=None,
        eos_token_id=256,
        pad_token_id=None,
    )
    torch.manual_seed(0)
    model = sharpen(transformers.Phi3ForCausalLM(config))
    model.save_pretrained(directory, safe_serialization=True)
    return directory, model


def test_a_served_context_past_the_original_serves_the_long_factors(
    tiny_phi3_longrope: tuple[Path, torch.nn.Module],
) -> None:
    directory, hf_model = tiny_phi3_longrope
    served = serve_greedy(directory, PROMPT, "--max-model-len", "64", *FLOAT32)
    assert len(served.events[0].prompt_tokens) > ORIGINAL
    assert served.plan["rope"].startswith(
        "long-factors (LongRoPE: the served context (--max-model-len 64: 64) exceeds the original 32 positions"
    )
    assert_transformers_tokens_and_prompt_logprobs(hf_model, served)
