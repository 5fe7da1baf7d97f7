"""OpenAI's chat and completions answers, shaped from tokenmill's `GenerateResponse` messages: a whole
answer, or a stream's chunks (``ResponseBuilder``, which the APIs served through the chat path subclass)."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any, ClassVar

from tokenmill_service.front.http.openai_protocol import ParsedRequest
from tokenmill_service.front.http.openai_tools import tool_calls_json
from tokenmill_service.front.proto import pb

_FINISH = {
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_CONTEXT_LIMIT: "length",
    pb.FINISH_REASON_EOS: "stop",
    pb.FINISH_REASON_STOP_SEQUENCE: "stop",
    pb.FINISH_REASON_TOOL_CALLS: "tool_calls",
}


def usage_json(usage: pb.Usage) -> dict[str, int]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def finish_reason(response: pb.GenerateResponse) -> str | None:
    return _FINISH.get(response.finish_reason)


def _visible(tokens: Sequence[pb.Token]) -> list[pb.Token]:
    # Special tokens (EOS, end of turn) are not part of the text, so OpenAI's logprobs leave them out.
    return [t for t in tokens if not t.special]


def chat_logprobs(tokens: Sequence[pb.Token]) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": t.text,
                "logprob": t.logprob,
                "bytes": list(t.text.encode()),
                "top_logprobs": [
                    {"token": a.text, "logprob": a.logprob, "bytes": list(a.text.encode())} for a in t.top_logprobs
                ],
            }
            for t in _visible(tokens)
        ]
    }


def completion_logprobs(
    tokens: Sequence[pb.Token], text_offset: int, prompt_tokens: Sequence[pb.Token] = (), echo: bool = False
) -> dict[str, Any]:
    """OpenAI's legacy shape; with echo the prompt's tokens come first, all of them (the first has no
    logprob: null, as OpenAI's), so that position i is the prompt's token i, and every generated token
    follows, special ones (EOS) included: a scorer (lm-evaluation-harness) asks for one token more than
    the prompt and drops the last position, whatever that token is."""
    shown = [*prompt_tokens, *(tokens if echo else _visible(tokens))]
    offsets = []
    for t in shown:
        offsets.append(text_offset)
        text_offset += len(t.text)
    return {
        "tokens": [t.text for t in shown],
        "token_logprobs": [t.logprob if t.HasField("logprob") else None for t in shown],
        "top_logprobs": [{a.text: a.logprob for a in t.top_logprobs} if t.HasField("logprob") else None for t in shown],
        "text_offset": offsets,
    }


class ResponseBuilder:
    """Shapes one request's GenerateResponse messages into OpenAI chunks or a whole response.

    ``echo_texts``: with echo, each prompt's text (what the answer starts with), one per request.
    With n > 1 a prompt's responses interleave its choices (GenerateResponse.index); prompt i's
    choice j is the answer's choice i * n + j, as OpenAI numbers them.

    Another API served through the chat path (anthropic_protocol.py, responses_protocol.py) subclasses it:
    its answer is the chat answer reshaped, and a stream's events, their framing and its errors are its own
    (the methods from ``events`` down)."""

    # What ends a stream, after its last event.
    STREAM_END: ClassVar[bytes] = b"data: [DONE]\n\n"
    # A stream's events as bare `data:` lines (OpenAI's chat and completions), or each named by its type
    # (`event: TYPE`, as Anthropic's and the Responses API's are).
    NAMED_EVENTS: ClassVar[bool] = False

    def __init__(self, parsed: ParsedRequest, request_id: str, model: str, echo_texts: Sequence[str] = ()) -> None:
        self.parsed = parsed
        self.chat = parsed.chat
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + request_id
        self.created = int(time.time())
        # The server's name for its model (what /v1/models lists), whatever name the request used.
        self.model = model or parsed.model
        self.echo_texts = list(echo_texts) if parsed.echo else []
        # A stream's state per choice: the text sent so far (for text_offset), its echo sent or not.
        self.text_offset: dict[int, int] = {}
        self.echoed: set[int] = set()
        self.prompt_tokens: Sequence[pb.Token] = ()  # with echo: choice 0's, shown with every choice
        self.usage = pb.Usage()  # a stream's, summed as its choices finish

    def _envelope(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _logprobs(
        self, index: int, tokens: Sequence[pb.Token], prompt_tokens: Sequence[pb.Token] = ()
    ) -> dict[str, Any] | None:
        if not self.parsed.request.logprobs:
            return None
        if self.chat:
            return chat_logprobs(tokens)
        shaped = completion_logprobs(tokens, self.text_offset.get(index, 0), prompt_tokens, self.parsed.echo)
        self.text_offset[index] = self.text_offset.get(index, 0) + sum(len(t) for t in shaped["tokens"])
        return shaped

    def first_chunks(self) -> list[dict[str, Any]]:
        """Chat streams open with the assistant's role, one chunk per choice, as OpenAI's do."""
        if not self.chat:
            return []
        return [
            self._chunk(
                {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            )
            for i in range(self.parsed.n)
        ]

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        chunk = self._envelope("chat.completion.chunk" if self.chat else "text_completion")
        chunk["choices"] = [choice]
        if self.parsed.include_usage:
            chunk["usage"] = None
        return chunk

    def _shown(self, response: pb.GenerateResponse) -> tuple[str, Sequence[pb.Token]]:
        """What of a response the caller sees: nothing generated when echo asked for none."""
        return ("", ()) if self.parsed.echo_only else (response.text, response.tokens)

    def chunk(self, response: pb.GenerateResponse) -> dict[str, Any] | None:
        """One streamed chunk, or None when the response adds nothing a client would see."""
        index = response.index
        if response.prompt_tokens:
            self.prompt_tokens = response.prompt_tokens
        reason = finish_reason(response)
        if reason is not None:
            one = self._usage(response)
            self.usage.prompt_tokens = one.prompt_tokens  # the same prompt for every choice: once
            self.usage.completion_tokens += one.completion_tokens
        text, tokens = self._shown(response)
        prompt_tokens: Sequence[pb.Token] = ()
        if self.echo_texts and index not in self.echoed:
            self.echoed.add(index)
            text, prompt_tokens = self.echo_texts[0] + text, self.prompt_tokens
        calls = tool_calls_json(response.tool_calls, delta=True) if reason is not None else []
        reasoning = response.reasoning_text
        if not text and not reasoning and not tokens and not prompt_tokens and reason is None:
            return None
        choice: dict[str, Any] = {"index": index}
        if self.chat:
            choice["delta"] = {"content": text} if text or reason is None else {}
            if reasoning:
                choice["delta"]["reasoning_content"] = reasoning
            if calls:
                choice["delta"]["tool_calls"] = calls
        else:
            choice["text"] = text
        choice["logprobs"] = self._logprobs(index, tokens, prompt_tokens)
        choice["finish_reason"] = reason
        return self._chunk(choice)

    def _usage(self, last: pb.GenerateResponse) -> pb.Usage:
        # The token generated for echo alone is not part of the answer.
        return (
            pb.Usage(prompt_tokens=last.usage.prompt_tokens, completion_tokens=0)
            if self.parsed.echo_only
            else last.usage
        )

    def usage_chunk(self) -> dict[str, Any]:
        chunk = self._envelope("chat.completion.chunk" if self.chat else "text_completion")
        chunk["choices"] = []
        chunk["usage"] = usage_json(self.usage)
        return chunk

    def events(self, response: pb.GenerateResponse) -> list[dict[str, Any]]:
        """A stream's events for one response (OpenAI's: a chunk, or none)."""
        chunk = self.chunk(response)
        return [] if chunk is None else [chunk]

    def last_events(self) -> list[dict[str, Any]]:
        """What a stream sends after its last response."""
        return [self.usage_chunk()] if self.parsed.include_usage else []

    def sse(self, event: dict[str, Any]) -> bytes:
        """One event as server-sent."""
        data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
        return (f"event: {event['type']}\n" if self.NAMED_EVENTS else "").encode() + f"data: {data}\n\n".encode()

    @staticmethod
    def error_body(status: int, body: dict[str, Any]) -> dict[str, Any]:
        """A refusal's body, from OpenAI's error JSON (``error_json``) and its HTTP status."""
        return body

    def error_event(self, status: int, body: dict[str, Any]) -> dict[str, Any]:
        """A failure after a stream's status was sent, from OpenAI's error JSON: the stream's last event."""
        return body

    def whole(self, results: Sequence[Sequence[pb.GenerateResponse]]) -> dict[str, Any]:
        """The non-streaming answer: per request (prompt) and choice, every response's text and tokens
        joined. Usage counts each prompt once and every choice's tokens."""
        choices, usage = [], pb.Usage()
        n = self.parsed.n
        for prompt_index, responses in enumerate(results):
            by_choice: list[list[pb.GenerateResponse]] = [[] for _ in range(n)]
            for r in responses:
                by_choice[r.index].append(r)
            prompt_tokens: Sequence[pb.Token] = ()
            for r in by_choice[0][:1]:
                prompt_tokens = r.prompt_tokens
            for j, mine in enumerate(by_choice):
                index = prompt_index * n + j
                shown = [self._shown(r) for r in mine]
                text = "".join(t for t, _ in shown)
                tokens = [t for _, ts in shown for t in ts]
                echoed: Sequence[pb.Token] = ()
                if self.echo_texts:
                    text, echoed = self.echo_texts[prompt_index] + text, prompt_tokens
                last = mine[-1]
                choice: dict[str, Any] = {"index": index}
                if self.chat:
                    choice["message"] = {"role": "assistant", "content": text}
                    if reasoning := "".join(r.reasoning_text for r in mine):
                        choice["message"]["reasoning_content"] = reasoning
                    if last.tool_calls:
                        # The text before the calls (the calls' own text is never in it).
                        choice["message"]["content"] = text.strip() or None
                        choice["message"]["tool_calls"] = tool_calls_json(last.tool_calls)
                else:
                    choice["text"] = text
                choice["logprobs"] = self._logprobs(index, tokens, echoed)
                choice["finish_reason"] = finish_reason(last)
                choices.append(choice)
                one = self._usage(last)
                if j == 0:
                    usage.prompt_tokens += one.prompt_tokens
                usage.completion_tokens += one.completion_tokens
        answer = self._envelope("chat.completion" if self.chat else "text_completion")
        answer["choices"] = choices
        answer["usage"] = usage_json(usage)
        return answer
