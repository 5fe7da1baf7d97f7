"""`tokenmill-server --backend triton`: refused at once without a GPU (unless Triton's interpreter is
on), and with TRITON_INTERPRET=1 transformers' greedy tokens and prompt logprobs through the RPC, on a
tiny random Llama checkpoint written here (Qwen3's: tests/service/test_qwen3_served.py)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.served_family import FLOAT32, assert_transformers_tokens_and_prompt_logprobs, serve_greedy_each
from tests.server_process import SERVER
from tests.tiny_checkpoint import write_tiny_llama

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

PROMPTS = ["Hello, tokenmill!", "The triton backend runs its kernels in the interpreter here; " * 3]
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def test_triton_in_the_interpreter_serves_transformers_tokens_and_prompt_logprobs(tiny_llama: Path) -> None:
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype="float32").eval()
    flags = ("--backend", "triton", *FLOAT32)
    runs = serve_greedy_each(tiny_llama, PROMPTS, *flags, new_tokens=NEW_TOKENS, env={"TRITON_INTERPRET": "1"})
    for served in runs:
        assert served.backend == "triton" and served.plan["dtype"].startswith("float32")
        assert_transformers_tokens_and_prompt_logprobs(hf_model, served, NEW_TOKENS)


def test_triton_without_a_gpu_or_the_interpreter_exits_2_before_loading_the_model(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # The model path does not exist: reaching it would be another error, so the refusal comes first.
    start = time.monotonic()
    result = subprocess.run(
        [str(SERVER), "--backend", "triton", "--device", "cpu", "--model", str(tmp_path / "absent.gguf")],
        env=env,
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    assert "--backend triton needs a GPU" in result.stderr
    assert "--backend torch" in result.stderr and "TRITON_INTERPRET=1" in result.stderr
    assert time.monotonic() - start < 30
