"""A request's choices, as the engine's outputs for them arrive, turned into `GenerateResponse` messages.

A harmony model's chat answers have their analysis channel read apart as the reasoning, and their calls
(messages to functions.NAME) apart from the answer, by a reader per choice (harmony.py). Other families' calls
are read from each choice's whole answer when it ends; its text streams as it comes, but for what may be a call
(held back, and shown only if it was none: tool_calls.HeldText). A choice's last response carries its finish
reason, calls, usage and timing; the token-timing metrics are observed as the tokens come.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import grpc

from tokenmill_service.contract.chat.harmony import ChannelReader
from tokenmill_service.contract.chat.tool_calls import HeldText, ToolCall, parse_calls, repeats_a_call
from tokenmill_service.contract.request import FinishReason, RequestOutput, TokenOutput
from tokenmill_service.contract.tokenizer import Tokenizer
from tokenmill_service.front.metrics import Metrics
from tokenmill_service.front.proto import pb
from tokenmill_service.front.router import RequestStream
from tokenmill_service.front.tool_validation import family, tools_in_use

FINISH_REASONS = {
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.EOS: pb.FINISH_REASON_EOS,
    FinishReason.STOP_SEQUENCE: pb.FINISH_REASON_STOP_SEQUENCE,
    FinishReason.CONTEXT_LIMIT: pb.FINISH_REASON_CONTEXT_LIMIT,
}


def token_proto(t: TokenOutput) -> pb.Token:
    tok = pb.Token(id=t.id, text=t.text, special=t.special)
    if t.logprob is not None:
        tok.logprob = t.logprob
    for alt in t.top_logprobs:
        tok.top_logprobs.add(id=alt.id, text=alt.text, logprob=alt.logprob)
    return tok


@dataclass
class RequestTally:
    """What the request_finished line and the request metrics report of one call: how it ended, its tokens, its
    times (``field`` and ``reason``: an invalid field's, see ServiceError)."""

    arrival: float
    code: grpc.StatusCode = grpc.StatusCode.OK
    error: str = ""
    field: str | None = None
    reason: str | None = None
    prompt_len: int = 0
    completion_len: int = 0
    first_token_at: float | None = None
    finish: FinishReason | None = None


class ChoiceResponses:
    """The responses of a request's ``max(1, request.n)`` choices, one engine output at a time."""

    def __init__(
        self, request: pb.GenerateRequest, request_id: str, tokenizer: Tokenizer, metrics: Metrics, tally: RequestTally
    ) -> None:
        self.request_id = request_id
        self.metrics = metrics
        self.tally = tally
        n = max(1, request.n)
        harmony_chat = tokenizer.harmony and request.WhichOneof("input") == "chat"
        self.readers = (
            [ChannelReader(tokenizer, calls=tools_in_use(request)) for _ in range(n)] if harmony_chat else None
        )
        self.tool_family = family(tokenizer) if tools_in_use(request) and not harmony_chat else None
        self.held = [HeldText(self.tool_family) for _ in range(n)] if self.tool_family is not None else []
        self.answers = [""] * n
        self.completion_lens = [0] * n
        self.last_at = [tally.arrival] * n
        self.ended = [False] * n
        self.queue_s = 0.0

    @property
    def all_ended(self) -> bool:
        return all(self.ended)

    def response(self, index: int, out: RequestOutput, stream: RequestStream) -> pb.GenerateResponse | None:
        """Choice ``index``'s output as a response; None once the choice ended (what its replica sent meanwhile
        is dropped). A choice that makes a call it already made ends here, and ``stream`` is closed."""
        if self.ended[index]:
            return None
        now = time.monotonic()
        self._observe_timing(index, out, now)
        self.completion_lens[index] = out.completion_len or self.completion_lens[index]
        self.tally.completion_len = sum(self.completion_lens)
        response = pb.GenerateResponse(
            request_id=self.request_id, text=out.text, tokens=[token_proto(t) for t in out.tokens], index=index
        )
        if out.prompt_tokens:
            response.prompt_tokens.extend(token_proto(t) for t in out.prompt_tokens)
        if self.readers is not None:
            response.reasoning_text, response.text = self.readers[index].feed([t.id for t in out.tokens])
        end = out.finish_reason
        if self.tool_family is not None:
            self.answers[index] += out.text
            response.text = self.held[index].add(out.text)
            if end is None and self.held[index].in_call and repeats_a_call(self.answers[index], self.tool_family):
                # It makes a call it already made: the answer ends here, as if it had ended
                # itself (tool_calls.repeats_a_call), and its replica stops generating it.
                end = FinishReason.EOS
                stream.close()
        if end is not None:
            self._end(response, index, end, now)
        return response

    def _observe_timing(self, index: int, out: RequestOutput, now: float) -> None:
        arrival = self.tally.arrival
        if out.queue_s is not None:
            self.queue_s = out.queue_s
        if not out.tokens:
            return
        if self.tally.first_token_at is None:
            self.tally.first_token_at = now
            self.metrics.time_to_first_token.observe(now - arrival)
            self.metrics.queue_time.observe(self.queue_s)
        elif self.last_at[index] != arrival:
            per_token = (now - self.last_at[index]) / len(out.tokens)
            for _ in out.tokens:
                self.metrics.inter_token_latency.observe(per_token)
        self.last_at[index] = now

    def _end(self, response: pb.GenerateResponse, index: int, end: FinishReason, now: float) -> None:
        """A choice's last response: its finish reason, its calls, usage and timing."""
        self.ended[index] = True
        self.tally.finish = finish = end
        response.finish_reason = FINISH_REASONS[end]
        # Calls completed before a length limit are kept, under the finish reason LENGTH.
        calls: list[ToolCall] = []
        if self.tool_family is not None:
            calls = parse_calls(self.answers[index], self.tool_family)[1]
            response.text += self.held[index].end(bool(calls), finish is FinishReason.EOS)
        elif self.readers is not None:
            calls = self.readers[index].calls
        response.tool_calls.extend(pb.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in calls)
        if calls and finish in (FinishReason.EOS, FinishReason.STOP_SEQUENCE):
            response.finish_reason = pb.FINISH_REASON_TOOL_CALLS
        arrival = self.tally.arrival
        response.usage.prompt_tokens = self.tally.prompt_len
        response.usage.completion_tokens = self.completion_lens[index]
        response.timing.queue_ms = self.queue_s * 1000
        response.timing.time_to_first_token_ms = ((self.tally.first_token_at or now) - arrival) * 1000
        response.timing.total_ms = (now - arrival) * 1000
