"""One tensor-parallel replica spanning two servers (`--nnodes 2 --node-rank 0|1 --master-addr
--master-port`, gloo): node 0 runs the router and ranks 0 and 1, node 1 runs rank 2 only. In the
reference configuration (float32, unquantized) it serves what one rank serves, and when node 1's rank
is killed mid-stream the group restarts on both nodes and the stream resumes."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from tests.server_process import ServerProcess, free_port
from tests.service.test_tensor_parallel_service import CHAT_TOKENS, engine_outputs, generate
from tokenmill_client._proto import generate_pb2 as pb
from tokenmill_client._proto import generate_pb2_grpc as pb_grpc
from tokenmill_service.contract.request import GenerationRequest, StoppingParams
from tokenmill_service.contract.tokenizer import load_tokenizer
from tokenmill_service.worker.engine.llm_engine import LLMEngine
from tokenmill_service.worker.loader import load_model, resolve_model_path

# Five processes loading the embedded model, then three again after the kill: minutes on CI's two cores.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.environ.get("TOKENMILL_TEST_MULTINODE") != "1",
        reason="a replica over two servers loads the model in five processes (minutes on 2 cores): "
        "set TOKENMILL_TEST_MULTINODE=1 to run it",
    ),
]

FLAGS = ("--tensor-parallel", "3", "--nnodes", "2", "--master-addr", "127.0.0.1", "--dtype", "float32")
FLAGS += ("--quantization", "none", "--heartbeat-timeout", "5", "--drain-seconds", "2")


@pytest.fixture(scope="module")
def nodes() -> Iterator[tuple[ServerProcess, ServerProcess]]:
    port = str(free_port())
    follower = ServerProcess(*FLAGS, "--node-rank", "1", "--master-port", port).launch()
    leader = ServerProcess(*FLAGS, "--node-rank", "0", "--master-port", port)
    try:
        leader.start(timeout=300)
        yield leader, follower
    finally:
        for node in (leader, follower):
            if node.proc is not None:
                node.stop()


@pytest.fixture(scope="module")
def stub(nodes: tuple[ServerProcess, ServerProcess]) -> Iterator[pb_grpc.GenerationStub]:
    with grpc.insecure_channel(nodes[0].address) as channel:
        yield pb_grpc.GenerationStub(channel)


def follower_pids(follower: ServerProcess) -> list[list[int]]:
    """The rank processes node 1 started, each time it started them."""
    found = []
    for line in follower.logs().splitlines():
        if line.startswith("{"):
            event = json.loads(line)
            if event.get("event") == "node_ranks_started":
                assert event["ranks"] == [2]
                found.append(event["pids"])
    return found


def test_a_replica_over_two_servers_serves_what_one_rank_serves(
    stub: pb_grpc.GenerationStub, nodes: tuple[ServerProcess, ServerProcess], reference: dict[str, Any]
) -> None:
    path = resolve_model_path(None)
    engine = LLMEngine(load_model(path, quantization="none"), load_tokenizer(path))
    chat = reference["chat"][0]
    want = engine_outputs(
        engine, GenerationRequest("chat", chat["ids"], stopping=StoppingParams(max_new_tokens=CHAT_TOKENS))
    )
    msgs = generate(
        stub,
        chat=pb.Messages(messages=[pb.ChatMessage(**m) for m in chat["messages"]]),
        stopping=pb.StoppingParams(max_new_tokens=CHAT_TOKENS),
    )
    assert [t.id for m in msgs for t in m.tokens] == [t.id for o in want for t in o.tokens]
    ids = reference["prompt_logprobs"][0]["ids"]
    one = engine_outputs(
        engine, GenerationRequest("plp", ids, stopping=StoppingParams(max_new_tokens=1), prompt_logprobs=True)
    )[0].prompt_tokens
    spread = generate(
        stub, token_ids=pb.TokenIds(ids=ids), stopping=pb.StoppingParams(max_new_tokens=1), prompt_logprobs=True
    )[0].prompt_tokens
    assert one is not None and len(spread) == len(one) == len(ids)
    assert max(abs(a.logprob - b.logprob) for a, b in zip(one[1:], spread[1:])) <= 1e-4  # type: ignore[operator]
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    # Node 0 holds ranks 0 and 1 of the replica's three; node 1 holds rank 2.
    assert info.tensor_parallel == 3 and info.num_workers == 1
    assert [r.rank for r in info.workers[0].ranks] == [0, 1]
    assert len(follower_pids(nodes[1])) == 1


def test_killing_the_other_nodes_rank_restarts_the_group_and_the_stream_resumes(
    stub: pb_grpc.GenerationStub, nodes: tuple[ServerProcess, ServerProcess]
) -> None:
    leader, follower = nodes
    [victim] = follower_pids(follower)[-1]
    first = threading.Event()
    result: dict[str, Any] = {}

    def one() -> None:
        tokens = 0
        call = stub.Generate(
            pb.GenerateRequest(
                prompt="Once upon a time", stopping=pb.StoppingParams(max_new_tokens=24, ignore_eos=True)
            ),
            timeout=240,
        )
        for msg in call:
            tokens += len(msg.tokens)
            if tokens:
                first.set()
            if msg.finish_reason:
                result["finish"] = msg.finish_reason
        result["tokens"] = tokens

    thread = threading.Thread(target=one)
    thread.start()
    assert first.wait(120)
    os.kill(victim, signal.SIGKILL)
    thread.join(240)
    # One stream: it moved to the restarted replica and finished, every token once.
    assert result.get("tokens") == 24, result
    assert '"worker_died"' in leader.logs()
    deadline = time.monotonic() + 60
    while len(follower_pids(follower)) < 2 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert len(follower_pids(follower)) >= 2 and victim not in follower_pids(follower)[-1]
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert info.workers[0].restarts >= 1 and info.workers[0].alive
