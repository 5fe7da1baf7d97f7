"""What a Generate stream produced, in a form compared bit for bit (batch invariance, resumption)."""

from __future__ import annotations

from tokenmill_client._proto import generate_pb2 as pb
from tokenmill_client._proto import generate_pb2_grpc as pb_grpc

# (token id, logprob, ((alternative id, logprob), ...)) per generated token.
Trace = list[tuple[int, float, tuple[tuple[int, float], ...]]]


async def trace(stub: pb_grpc.GenerationStub, request: pb.GenerateRequest) -> Trace:
    """Every generated token with its logprob and top alternatives: compared bit for bit."""
    return (await prompt_and_trace(stub, request))[1]


async def prompt_and_trace(
    stub: pb_grpc.GenerationStub, request: pb.GenerateRequest
) -> tuple[list[tuple[int, float]], Trace]:
    """The prompt's tokens with their logprobs (where the request asks for them), and the trace."""
    prompt: list[tuple[int, float]] = []
    out: Trace = []
    async for msg in stub.Generate(request, timeout=600):
        prompt.extend((t.id, t.logprob) for t in msg.prompt_tokens)
        out.extend((t.id, t.logprob, tuple((a.id, a.logprob) for a in t.top_logprobs)) for t in msg.tokens)
    return prompt, out
