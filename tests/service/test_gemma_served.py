"""`tokenmill-server --model` a Gemma 2 Hugging Face directory: through the RPC, over a prompt of four
sliding windows and more, transformers' greedy tokens and prompt logprobs (windows and soft caps
served by the native attention kernel), and a load plan that says why the layers run one by one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.engine.gemma_checkpoints import WINDOW
from tests.server_process import ServerProcess
from tests.tiny_checkpoint import write_byte_level_tokenizer
from tokenmill_client import Client

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

NEW_TOKENS = 8
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
    model = transformers.Gemma2ForCausalLM(config)
    with torch.no_grad():  # norms away from 0 (Gemma multiplies by 1 + w), sharper weights: no near-ties
        for name, param in model.named_parameters():
            param.copy_(torch.randn_like(param) * 0.1 if "norm" in name else torch.randn_like(param) * 0.2)
    model.save_pretrained(directory, safe_serialization=True)
    return directory, model.eval()


@torch.inference_mode()
def test_a_served_gemma2_gives_transformers_tokens_and_prompt_logprobs(
    tiny_gemma2: tuple[Path, torch.nn.Module],
) -> None:
    directory, hf_model = tiny_gemma2
    args = ("--model", str(directory), "--dtype", "float32", "--quantization", "none", "--drain-seconds", "1")
    server = ServerProcess(*args).start()
    try:
        with Client(server.address, timeout=120) as client:
            events = list(client.generate(PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True, prompt_logprobs=True))
            plan = dict(client.model_info().load_plan)
    finally:
        server.stop()
    assert plan["architecture"] == "gemma2"
    assert plan["executor"].startswith("eager (") and "gemma2 family has no native stack" in plan["executor"]

    prompt = events[0].prompt_tokens
    ids = [t.id for t in prompt]
    assert len(ids) > 4 * WINDOW
    expected = list(ids)
    for _ in range(NEW_TOKENS):
        expected.append(int(hf_model(torch.tensor([expected])).logits[0, -1].argmax()))
    assert [t.id for e in events for t in e.tokens] == expected[len(ids) :]
    logprobs = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0], dim=-1)
    for row, token in enumerate(prompt[1:]):
        assert token.logprob is not None and abs(token.logprob - logprobs[row, token.id].item()) < 1e-4
