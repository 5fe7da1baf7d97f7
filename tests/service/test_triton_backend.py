"""`tokenmill-server --backend triton`: refused at once without a GPU (unless Triton's interpreter is
on), and with TRITON_INTERPRET=1 the same greedy tokens and prompt logprobs as `--backend torch`
through the RPC, on a tiny random Llama checkpoint written here."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tests.server_process import SERVER, ServerProcess
from tests.tiny_checkpoint import write_tiny_llama
from tokenmill_client import Client

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

PROMPTS = ["Hello, tokenmill!", "The triton backend runs its kernels in the interpreter here; " * 3]
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def _serve_and_generate(model: Path, backend: str, env: dict[str, str]) -> tuple[list[Any], Any]:
    args = ("--model", str(model), "--backend", backend, "--dtype", "float32", "--quantization", "none")
    server = ServerProcess(*args, "--drain-seconds", "1", env=env).start()
    try:
        with Client(server.address, timeout=120) as client:
            runs = []
            for prompt in PROMPTS:
                events = list(client.generate(prompt, max_new_tokens=NEW_TOKENS, ignore_eos=True, prompt_logprobs=True))
                runs.append(([t.id for e in events for t in e.tokens], events[0].prompt_tokens))
            return runs, client.model_info()
    finally:
        server.stop()


def test_triton_in_the_interpreter_serves_what_torch_serves(tiny_llama: Path) -> None:
    torch_runs, torch_info = _serve_and_generate(tiny_llama, "torch", {})
    triton_runs, triton_info = _serve_and_generate(tiny_llama, "triton", {"TRITON_INTERPRET": "1"})
    assert (torch_info.backend, triton_info.backend) == ("torch", "triton")
    assert triton_info.dtype == "float32"
    for (want_ids, want_prompt), (got_ids, got_prompt) in zip(torch_runs, triton_runs, strict=True):
        assert len(got_ids) == NEW_TOKENS and got_ids == want_ids
        assert [t.id for t in got_prompt] == [t.id for t in want_prompt]
        for want, got in zip(want_prompt[1:], got_prompt[1:], strict=True):
            assert got.logprob == pytest.approx(want.logprob, abs=1e-4)


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
