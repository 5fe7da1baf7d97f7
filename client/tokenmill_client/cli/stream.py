"""One answer streamed to stdout as it is generated: as text, one line per token, or JSON lines."""

from __future__ import annotations

from collections.abc import Sequence

from .._chat import ChatMessage
from .._types import GenerateEvent
from ..client import Client
from .options import GenSettings
from .report import json_line, out, token_line, tool_call_lines


def stream_answer(
    client: Client, settings: GenSettings, *, prompt: str | None, messages: Sequence[ChatMessage] | None, mode: str
) -> tuple[GenerateEvent | None, str]:
    """Streams one generation to stdout (text, one line per token, or JSON lines).

    Returns the last event and the whole text. Ctrl-C propagates as KeyboardInterrupt once the call is cancelled.
    """
    stream = settings.stream(client, prompt, messages)
    last: GenerateEvent | None = None
    text: list[str] = []
    ends_with_newline = True
    try:
        for event in stream:
            text.append(event.text)
            if mode == "json":
                out(json_line(event))
            elif mode == "tokens":
                out("".join(token_line(t) for t in event.tokens))
            elif event.text:
                out(event.text)
                ends_with_newline = event.text.endswith("\n")
            if event.is_last:
                last = event
    finally:
        stream.close()  # cancels the call if we are leaving early (Ctrl-C, a broken pipe)
        if mode == "text" and not ends_with_newline:
            out("\n")
    if mode == "text" and last is not None and last.tool_calls:
        out(tool_call_lines(last.tool_calls))  # one JSON line per call, after the text they were read from
    return last, "".join(text)
