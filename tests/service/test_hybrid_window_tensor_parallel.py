"""A model mixing windowed and global layers, served over two tensor-parallel ranks.

Such a model keeps one block table per group of layers (the windowed groups free their blocks behind
the window), and the follower rank must build the same groups and follow rank 0's tables step by step.
A tiny Gemma 3 (five windowed layers, one global; a window of 8) decodes well past its window on two
ranks in the reference configuration (float32, unquantized), against one rank in this process.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from tests.engine.gemma_checkpoints import WINDOW, gemma3
from tests.server_process import ServerProcess
from tests.tiny_checkpoint import write_byte_level_tokenizer
from tokenmill_client._proto import generate_pb2 as pb
from tokenmill_client._proto import generate_pb2_grpc as pb_grpc
from tokenmill_service.contract.request import GenerationRequest, StoppingParams
from tokenmill_service.contract.tokenizer import load_tokenizer
from tokenmill_service.worker.engine.llm_engine import LLMEngine
from tokenmill_service.worker.loader import load_model

PROMPT = [(i * 5 + 1) % 90 + 3 for i in range(3 * WINDOW + 5)]  # three windows and more
NEW = 2 * WINDOW  # decoded tokens: two windows past the prompt


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-gemma3-tp")
    gemma3().save_pretrained(directory, safe_serialization=True)
    write_byte_level_tokenizer(directory)
    return directory


@pytest.fixture(scope="module")
def stub(checkpoint: Path) -> Iterator[pb_grpc.GenerationStub]:
    server = ServerProcess(
        "--model", str(checkpoint), "--tensor-parallel", "2", "--dtype", "float32", "--quantization", "none"
    ).start(timeout=300)
    try:
        with grpc.insecure_channel(server.address) as channel:
            yield pb_grpc.GenerationStub(channel)
    finally:
        server.stop()


def test_two_ranks_decode_past_the_window_as_one_rank_does(checkpoint: Path, stub: pb_grpc.GenerationStub) -> None:
    engine = LLMEngine(load_model(checkpoint, quantization="none"), load_tokenizer(checkpoint))
    assert engine.kv_groups.num_groups > 1  # the windowed layers' groups and the global one's
    engine.add_request(
        GenerationRequest(
            "one", PROMPT, stopping=StoppingParams(max_new_tokens=NEW, ignore_eos=True), logprobs=True,
            prompt_logprobs=True,
        )
    )  # fmt: skip
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    want_tokens = [(t.id, t.logprob) for o in outs for t in o.tokens]
    want_prompt = outs[0].prompt_tokens
    assert want_prompt is not None

    msgs = list(
        stub.Generate(
            pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=PROMPT),
                stopping=pb.StoppingParams(max_new_tokens=NEW, ignore_eos=True),
                logprobs=True,
                prompt_logprobs=True,
            ),
            timeout=120,
        )
    )
    got_tokens = [(t.id, t.logprob) for m in msgs for t in m.tokens]
    got_prompt = [t for m in msgs for t in m.prompt_tokens]
    assert [i for i, _ in got_tokens] == [i for i, _ in want_tokens]
    assert max(abs(a - b) for (_, a), (_, b) in zip(got_tokens, want_tokens)) <= 1e-4  # type: ignore[operator]
    assert len(got_prompt) == len(want_prompt) == len(PROMPT)
    assert max(abs(a.logprob - b.logprob) for a, b in zip(got_prompt[1:], want_prompt[1:])) <= 1e-4  # type: ignore[operator]

    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert info.tensor_parallel == 2
    # Per sequence, blocks of one layer's group at most (one table for all six layers would hold six).
    assert "blocks of 1 layer(s) at most" in info.kv_cache_per_sequence
