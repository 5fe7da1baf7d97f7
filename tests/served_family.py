"""What every served-family test does: serve a tiny transformers checkpoint with `tokenmill-server`
(a real server, real workers), generate greedily with prompt logprobs through the RPC, and hold the
result against transformers' float32 forward pass: the same greedy tokens, prompt logprobs within
1e-4 (at `--dtype float32 --quantization none`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.server_process import ServerProcess
from tokenmill_client import Client

# The flags of an exact comparison with transformers' float32 forward pass.
FLOAT32 = ("--dtype", "float32", "--quantization", "none", "--drain-seconds", "1")
NEW_TOKENS = 8
ATOL = 1e-4


@dataclass(slots=True)
class Served:
    """A greedy generation through the RPC: its events, and the load plan GetModelInfo reported."""

    events: list[Any]
    plan: dict[str, str]
    backend: str


def serve_greedy(
    directory: Path, prompt: str, *flags: str, new_tokens: int = NEW_TOKENS, env: dict[str, str] | None = None
) -> Served:
    """Start a server on ``directory`` with ``flags``, generate ``new_tokens`` greedily (EOS ignored)
    with prompt logprobs, stop it."""
    return serve_greedy_each(directory, [prompt], *flags, new_tokens=new_tokens, env=env)[0]


def serve_greedy_each(
    directory: Path, prompts: list[str], *flags: str, new_tokens: int = NEW_TOKENS, env: dict[str, str] | None = None
) -> list[Served]:
    """``serve_greedy`` for each of ``prompts`` in turn, from one server."""
    server = ServerProcess("--model", str(directory), *flags, env=env).start()
    try:
        with Client(server.address, timeout=120) as client:
            runs = [
                list(client.generate(p, max_new_tokens=new_tokens, ignore_eos=True, prompt_logprobs=True))
                for p in prompts
            ]
            info = client.model_info()
            return [Served(events, dict(info.load_plan), info.backend) for events in runs]
    finally:
        server.stop()


def assert_transformers_tokens_and_prompt_logprobs(hf_model: Any, served: Served, new_tokens: int = NEW_TOKENS) -> None:
    """The served greedy tokens are transformers' own (one full forward pass per token), and every
    prompt token's logprob within ``ATOL`` of transformers' float32 one."""
    import torch

    prompt = served.events[0].prompt_tokens
    ids = [t.id for t in prompt]
    expected = list(ids)
    with torch.inference_mode():
        for _ in range(new_tokens):
            expected.append(int(hf_model(torch.tensor([expected])).logits[0, -1].argmax()))
        logprobs = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0], dim=-1)
    assert [t.id for e in served.events for t in e.tokens] == expected[len(ids) :]
    for row, token in enumerate(prompt[1:]):
        assert token.logprob is not None and abs(token.logprob - logprobs[row, token.id].item()) < ATOL
