"""`tokenmill-server --model` a Qwen3 Hugging Face directory: through the RPC, transformers' greedy
tokens and prompt logprobs, and a load plan that says why the layers run one by one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.server_process import ServerProcess
from tests.tiny_checkpoint import write_byte_level_tokenizer
from tokenmill_client import Client

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

NEW_TOKENS = 8


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
    model = transformers.Qwen3ForCausalLM(config)
    with torch.no_grad():  # norms (q_norm and k_norm too) away from 1, sharper weights: no near-ties
        for name, param in model.named_parameters():
            param.copy_(torch.randn_like(param) * 0.1 + 1.0 if "norm" in name else torch.randn_like(param) * 0.2)
    model.save_pretrained(directory, safe_serialization=True)
    return directory, model.eval()


@torch.inference_mode()
def test_a_served_qwen3_gives_transformers_tokens_and_prompt_logprobs(
    tiny_qwen3: tuple[Path, torch.nn.Module],
) -> None:
    directory, hf_model = tiny_qwen3
    args = ("--model", str(directory), "--dtype", "float32", "--quantization", "none", "--drain-seconds", "1")
    server = ServerProcess(*args).start()
    try:
        with Client(server.address, timeout=120) as client:
            events = list(
                client.generate("Hello, Qwen3!", max_new_tokens=NEW_TOKENS, ignore_eos=True, prompt_logprobs=True)
            )
            plan = dict(client.model_info().load_plan)
    finally:
        server.stop()
    assert plan["architecture"] == "qwen3"
    assert plan["executor"].startswith("eager (") and "qwen3 family has no native stack" in plan["executor"]

    prompt = events[0].prompt_tokens
    ids = [t.id for t in prompt]
    expected = list(ids)
    for _ in range(NEW_TOKENS):
        expected.append(int(hf_model(torch.tensor([expected])).logits[0, -1].argmax()))
    assert [t.id for e in events for t in e.tokens] == expected[len(ids) :]
    logprobs = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0], dim=-1)
    for row, token in enumerate(prompt[1:]):
        assert token.logprob is not None and abs(token.logprob - logprobs[row, token.id].item()) < 1e-4
