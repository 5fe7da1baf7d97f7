"""Continuous batching through the RPC: many streams at once, cancellation, batch-independent seeds."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc

from tests.streams import trace
from tokenmill_client._proto import generate_pb2 as pb
from tokenmill_client._proto import generate_pb2_grpc as pb_grpc


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def collect(stub: pb_grpc.GenerationStub, request: pb.GenerateRequest) -> list[int]:
    ids: list[int] = []
    async for msg in stub.Generate(request, timeout=300):
        ids.extend(t.id for t in msg.tokens)
    return ids


async def engine_state(stub: pb_grpc.GenerationStub) -> pb.EngineState:
    info = await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    return info.engine


def chat(text: str) -> pb.Messages:
    return pb.Messages(messages=[pb.ChatMessage(role="user", content=text)])


def test_64_concurrent_streams_all_finish_and_cancelling_32_frees_every_block(server_address: str) -> None:
    async def main() -> None:
        async with grpc.aio.insecure_channel(server_address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            stop = pb.StoppingParams(max_new_tokens=24, ignore_eos=True)
            calls = [
                stub.Generate(pb.GenerateRequest(prompt=f"Story {i}:", stopping=stop), timeout=300) for i in range(64)
            ]
            # Cancel half of them once each has produced its first message.
            for call in calls[:32]:
                await call.read()
                call.cancel()
            finished = []
            for call in calls[32:]:
                tokens = 0
                async for msg in call:
                    tokens += len(msg.tokens)
                    if msg.finish_reason:
                        finished.append((msg.finish_reason, tokens))
            assert finished == [(pb.FINISH_REASON_LENGTH, 24)] * 32
            for call in calls[:32]:
                assert await call.code() == grpc.StatusCode.CANCELLED
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                state = await engine_state(stub)
                if state.kv_blocks_used == 0 and state.running == 0 and state.waiting == 0:
                    break
                await asyncio.sleep(0.05)
            assert (state.kv_blocks_used, state.running, state.waiting) == (0, 0, 0)
            assert state.kv_blocks_total > 0

    run(main())


SEEDED = pb.GenerateRequest(
    chat=chat("Write a haiku about the sea."),
    sampling=pb.SamplingParams(temperature=0.9, top_p=0.95, seed=77),
    stopping=pb.StoppingParams(max_new_tokens=24, ignore_eos=True),
    top_logprobs=3,
)
GREEDY = pb.GenerateRequest(
    chat=chat("Name three rivers."), stopping=pb.StoppingParams(max_new_tokens=24, ignore_eos=True), top_logprobs=3
)


def test_tokens_and_logprobs_are_bitwise_the_same_alone_and_among_15_others(server_address: str) -> None:
    """The README's promise, in the default configuration: a request's results do not depend on its batch,
    even when the batch holds other decodes and long prompts being prefilled in chunks at the same time."""

    async def main() -> None:
        async with grpc.aio.insecure_channel(server_address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            alone_seeded = await trace(stub, SEEDED)
            alone_greedy = await trace(stub, GREEDY)
            others = [
                pb.GenerateRequest(
                    prompt=f"Item {i} of the list is",
                    sampling=pb.SamplingParams(temperature=1.0),
                    stopping=pb.StoppingParams(max_new_tokens=10 + i, ignore_eos=True),
                )
                for i in range(13)
            ]
            # Long prompts (over one 512-token step) arrive alongside and are prefilled in chunks.
            others += [
                pb.GenerateRequest(
                    token_ids=pb.TokenIds(ids=[(97 * i + j) % 40000 + 100 for j in range(600 + 50 * i)]),
                    stopping=pb.StoppingParams(max_new_tokens=4, ignore_eos=True),
                )
                for i in range(2)
            ]
            batch = [*others[:7], SEEDED, GREEDY, *others[7:]]
            assert len(batch) == 17  # the two under test among 15 others
            results = await asyncio.gather(*(trace(stub, r) for r in batch))
            assert results[7] == alone_seeded
            assert results[8] == alone_greedy
            # With its prefix now cached, the same greedy request gives the same again.
            assert await trace(stub, GREEDY) == alone_greedy

    run(main())


def test_a_prefilled_prefix_gives_the_logprobs_its_decoding_gave(server_address: str) -> None:
    """One prefill of prompt + the first 20 generated tokens scores them exactly as generating them did."""

    async def main() -> None:
        async with grpc.aio.insecure_channel(server_address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            decoded = await trace(stub, GREEDY)
            prompt = (await stub.Tokenize(pb.TokenizeRequest(chat=GREEDY.chat), timeout=30)).ids
            ids = [*prompt, *(t for t, _, _ in decoded[:20])]
            request = pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=ids),
                stopping=pb.StoppingParams(max_new_tokens=1),
                prompt_logprobs=True,
                top_logprobs=3,
            )
            first = await stub.Generate(request, timeout=600).read()
            scored = [
                (t.id, t.logprob, tuple((a.id, a.logprob) for a in t.top_logprobs))
                for t in first.prompt_tokens[len(prompt) :]
            ]
            assert scored == decoded[:20]

    run(main())


REPEATING = pb.GenerateRequest(
    chat=chat("Repeat this line ten times: the cat sat on the mat, the dog sat on the log."),
    stopping=pb.StoppingParams(max_new_tokens=48, ignore_eos=True),
    top_logprobs=3,
)


def test_speculation_alone_gives_what_plain_decoding_in_a_crowd_gives(server_address: str) -> None:
    """The default server guesses drafts while few sequences run (--speculative-max-batch 4) and not
    in a crowd: the repeating request alone (drafts kept, several tokens a step) and among 15 others
    (no drafts, one token a step) gives the same tokens and logprobs, bit for bit."""

    async def main() -> None:
        async with grpc.aio.insecure_channel(server_address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            before = await engine_state(stub)
            alone = await trace(stub, REPEATING)
            after = await engine_state(stub)
            assert after.draft_tokens_accepted - before.draft_tokens_accepted > 10
            others = [
                pb.GenerateRequest(prompt=f"Fact {i}:", stopping=pb.StoppingParams(max_new_tokens=60, ignore_eos=True))
                for i in range(15)
            ]
            crowd = await asyncio.gather(*(trace(stub, r) for r in [*others[:8], REPEATING, *others[8:]]))
            assert crowd[8] == alone

    run(main())
