"""The same tokens and logprobs on every CPU: a server whose kernels are built for another instruction set
(``--cpu-isa scalar``, ``avx2``, ``avx512``, ``neon``) answers a request with exactly the default server's
bits, greedy and seeded, alone and among 15 others (decodes and a long prompt, which the instruction set's
server prefills in two chunks of its smaller steps where the default server takes it whole), prompt logprobs
included. So a stream resumed on a replica with another CPU goes on bit for bit. This machine
serves every instruction set it runs, with torch's own kernels as each CPU would pick them; the ARM64 kernels' bits are checked under qemu (test_arm64.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from tests.native import runner
from tests.server_process import ServerProcess
from tests.streams import prompt_and_trace
from tokenmill_client._proto import generate_pb2 as pb
from tokenmill_client._proto import generate_pb2_grpc as pb_grpc
from tokenmill_service.contract.plan import cpu_isa


def chat(text: str) -> pb.Messages:
    return pb.Messages(messages=[pb.ChatMessage(role="user", content=text)])


SEEDED = pb.GenerateRequest(
    chat=chat("Write a haiku about the sea."),
    sampling=pb.SamplingParams(temperature=0.9, top_p=0.95, seed=77),
    stopping=pb.StoppingParams(max_new_tokens=8, ignore_eos=True),
    top_logprobs=3,
)
GREEDY = pb.GenerateRequest(
    chat=chat("Name three rivers."),
    stopping=pb.StoppingParams(max_new_tokens=8, ignore_eos=True),
    top_logprobs=3,
    prompt_logprobs=True,
)


async def results(address: str) -> dict[str, Any]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        info = await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
        alone = {"seeded": await prompt_and_trace(stub, SEEDED), "greedy": await prompt_and_trace(stub, GREEDY)}
        others = [
            pb.GenerateRequest(
                prompt=f"Item {i} of the list is",
                sampling=pb.SamplingParams(temperature=1.0, seed=i),
                stopping=pb.StoppingParams(max_new_tokens=2 + i % 3, ignore_eos=True),
            )
            for i in range(14)
        ]
        # A long prompt beside the decodes: over one of the instruction set's server's steps (STEP_TOKENS).
        others.append(
            pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=[(97 * j) % 40000 + 100 for j in range(LONG)]),
                stopping=pb.StoppingParams(max_new_tokens=2, ignore_eos=True),
                prompt_logprobs=True,
            )
        )
        batch = [*others[:7], SEEDED, GREEDY, *others[7:]]
        crowd = await asyncio.gather(*(prompt_and_trace(stub, r) for r in batch))
        return {"plan": dict(info.load_plan), "alone": alone, "crowd": crowd}


@pytest.fixture(scope="module")
def default_results(server_address: str) -> dict[str, Any]:
    return asyncio.run(results(server_address))


# The instruction sets' servers take steps of STEP_TOKENS: LONG is two of their prefill chunks and one of the
# default server's 512-token steps, so the bits hold across chunkings too. (Small, for the plain C++ build's sake:
# its prefill runs at about 2 tokens a second a core.)
STEP_TOKENS = 64
LONG = 100

ATEN_CAPABILITY = {"scalar": "default", "avx2": "avx2", "avx2vnni": "avx2", "avx512": "avx512"}


@pytest.fixture(scope="module", params=[s.name for s in cpu_isa.INSTRUCTION_SETS])
def isa_server(request: pytest.FixtureRequest) -> Iterator[tuple[str, ServerProcess]]:
    isa = str(request.param)
    if (why := cpu_isa.missing(isa)) is not None:
        pytest.skip(f"--cpu-isa {isa} cannot run here: {why}")
    runner.wait_for_the_other_builds()  # (its server loads them)
    # torch's own kernels as that CPU would pick them too (ATen's vector width), for what runs outside tokenmill's
    # kernels: the server's bits must not depend on them either.
    env = {"ATEN_CPU_CAPABILITY": ATEN_CAPABILITY[isa]} if isa in ATEN_CAPABILITY else {}
    proc = ServerProcess(
        "--cpu-isa", isa, "--max-batch-tokens", str(STEP_TOKENS), "--drain-seconds", "2", env=env
    ).start(timeout=600)
    yield isa, proc
    proc.stop()


def test_every_instruction_set_serves_the_default_servers_bits(
    default_results: dict[str, Any], isa_server: tuple[str, ServerProcess]
) -> None:
    isa, proc = isa_server
    got = asyncio.run(results(proc.address))
    assert got["plan"]["cpu_isa"].startswith(f"{isa} (asked (--cpu-isa {isa})")
    # The default server's: auto's choice, or TOKENMILL_CPU_ISA's where it is set (as make test-avx2 sets it).
    assert default_results["plan"]["cpu_isa"].startswith(f"{cpu_isa.selected()} (")
    # The crowd's two requests under test are the ones served alone, and every request's bits are the default's.
    assert got["crowd"][7] == got["alone"]["seeded"] and got["crowd"][8] == got["alone"]["greedy"]
    assert got["alone"] == default_results["alone"]
    assert got["crowd"] == default_results["crowd"]
    assert len(got["alone"]["greedy"][0]) > 5 and len(got["crowd"][-1][0]) == LONG  # prompt logprobs were compared


def test_an_instruction_set_the_cpu_lacks_stops_the_server_at_start_naming_what_is_missing() -> None:
    lacking = next((s.name for s in cpu_isa.INSTRUCTION_SETS if cpu_isa.missing(s.name) is not None), None)
    assert lacking is not None  # no CPU runs both x86's and ARM's
    proc = ServerProcess("--cpu-isa", lacking).launch()
    assert proc.proc is not None
    code = proc.proc.wait(timeout=120)
    assert code == 2, proc.logs()[-2000:]
    assert f"--cpu-isa {lacking} cannot run here: " in proc.logs()
