"""The harmony chat format (gpt-oss): conversations rendered with openai's ``openai-harmony`` package, and
the answer's channels read back token by token.

A harmony model's tokenizer has harmony's control tokens (``<|start|>``, ``<|channel|>``,
``<|message|>``, ``<|end|>``, ``<|return|>``, ``<|call|>``); such a tokenizer renders chats here instead
of with a Jinja template. A message is ``<|start|>{role}<|channel|>{channel}<|message|>{text}<|end|>``;
the model answers in the ``analysis`` channel (its reasoning), then the ``final`` one (the answer),
ending with ``<|return|>`` (or ``<|call|>`` for a tool call), so ``<|end|>`` does not end the turn.

- Rendering: the OpenAI-style messages become a harmony ``Conversation`` (a default system message; the
  caller's "system" / "developer" messages as the developer's instructions, with the tools offered and the
  JSON schema the answer must match described (harmony_response_format.py); user and
  assistant turns, the latter in the final channel; tool calls and results as harmony_tools.py writes them)
  and ``render_conversation_for_completion`` gives harmony's ids. Its control
  tokens map to the model's by text, and the text between them is encoded with the model's tokenizer (for
  gpt-oss's own o200k vocabulary the ids are the same), so message text never becomes a control token.
- Reading: ``ChannelReader`` follows the generated tokens: the analysis channel's text is the reasoning
  (``reasoning_content`` over HTTP, ``reasoning_text`` over gRPC), a commentary message to
  ``functions.NAME`` a tool call (when tools are offered), every other message's text the answer.

openai-harmony reads the o200k_base vocabulary from the directory ``TIKTOKEN_ENCODINGS_BASE`` names (it
would download it otherwise); ``make tools`` writes it to ``.tools/tiktoken/`` from npm's js-tiktoken,
checked against its published SHA-256 (scripts/install_tools.sh).
"""

from __future__ import annotations

import codecs
import os
import re
from collections.abc import Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import Any, Protocol

from tokenmill_service.contract.chat.harmony_response_format import ResponseFormat, developer_message
from tokenmill_service.contract.chat.tool_calls import ToolCall, new_call_id

CONTROL = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>")
# Tokens that end a harmony turn (``<|end|>`` ends only a message).
TURN_ENDS = ("<|return|>", "<|call|>")
REASONING_CHANNEL = "analysis"
# A message to functions.NAME is a call of the function NAME (harmony_tools.py offers them so).
CALL_PREFIX = "functions."
# In a message's header: its channel (after <|channel|>) and its recipient (to=..., before or after it).
_CHANNEL = re.compile(r"<\|channel\|>\s*([^\s<]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
VOCABULARY = "o200k_base.tiktoken"


class HarmonyUnavailable(ValueError):
    """openai-harmony cannot load its encoding here (its vocabulary file is not found)."""


class TokenSource(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def token_bytes(self, token_id: int) -> bytes: ...

    def is_special(self, token_id: int) -> bool: ...

    def special_id(self, text: str) -> int | None: ...


def is_harmony(special_texts: Sequence[str] | frozenset[str]) -> bool:
    """Whether a tokenizer with these control tokens speaks harmony."""
    return all(t in special_texts for t in CONTROL)


@cache
def encoding() -> Any:
    """openai-harmony's gpt-oss encoding (loaded once). Its vocabulary is read from the directory
    TIKTOKEN_ENCODINGS_BASE names or, where that is unset, from `make tools`'s .tools/tiktoken under the
    working directory (a server started from the checkout, as `make run` starts it)."""
    base = os.environ.get("TIKTOKEN_ENCODINGS_BASE")
    local = Path.cwd() / ".tools" / "tiktoken"
    if not base and (local / VOCABULARY).is_file():
        base = os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(local)  # openai-harmony reads the variable
    if not base or not (Path(base) / VOCABULARY).is_file():
        raise HarmonyUnavailable(
            f"the harmony chat format needs {VOCABULARY} in the directory TIKTOKEN_ENCODINGS_BASE names "
            f"({base or 'unset'}, and none in ./.tools/tiktoken); `make tools` writes it to .tools/tiktoken"
        )
    import openai_harmony as oh

    return oh.load_harmony_encoding(oh.HarmonyEncodingName.HARMONY_GPT_OSS)


def render(
    messages: Sequence[Mapping[str, Any]],
    tokenizer: TokenSource,
    tools: Sequence[Mapping[str, Any]] | None = None,
    response_format: ResponseFormat | None = None,
) -> list[int]:
    """The prompt ids of an OpenAI-style conversation, up to the assistant's turn (``<|start|>assistant``).
    ``tools`` (OpenAI-shaped) are offered in the first developer message, and ``response_format`` described
    at its end (harmony_response_format.py); one is added when the caller gave no "system" or "developer"
    message. Assistant ``tool_calls`` and "tool" messages become harmony's calls and results
    (harmony_tools.py)."""
    import openai_harmony as oh

    from tokenmill_service.contract.chat import harmony_tools

    enc = encoding()
    offered = harmony_tools.function_tools(tools) if tools else []
    conversation = [oh.Message.from_role_and_content(oh.Role.SYSTEM, oh.SystemContent.new())]
    names: dict[str, str] = {}  # a call's id -> its function's name
    first = True  # the first developer message holds the tools and the response format
    for i, message in enumerate(messages):
        role, content = message["role"], str(message.get("content") or "")
        if role in ("system", "developer"):
            developer = oh.DeveloperContent.new().with_instructions(content)
            if first and offered:
                developer = developer.with_function_tools(offered)
            conversation.append(developer_message(developer, response_format if first else None))
            first = False
        elif role == "user":
            conversation.append(oh.Message.from_role_and_content(oh.Role.USER, content))
        elif role == "assistant" and message.get("tool_calls"):
            conversation += harmony_tools.call_messages(message, names, i)
        elif role == "assistant":
            answer = oh.Message.from_role_and_content(oh.Role.ASSISTANT, content).with_channel("final")
            conversation.append(answer)
        elif role == "tool":
            conversation.append(harmony_tools.result_message(message, names, i))
        else:
            raise ValueError(f"message {i} has role {role!r}, which the harmony format does not take here")
    if first and (offered or response_format is not None):
        developer = oh.DeveloperContent.new()
        if offered:
            developer = developer.with_function_tools(offered)
        conversation.insert(1, developer_message(developer, response_format))
    ids = enc.render_conversation_for_completion(oh.Conversation.from_messages(conversation), oh.Role.ASSISTANT)
    return to_model_ids(list(ids), tokenizer)


def to_model_ids(harmony_ids: Sequence[int], tokenizer: TokenSource) -> list[int]:
    """harmony's ids as the model's: control tokens by text, the text between them encoded."""
    enc = encoding()
    out: list[int] = []
    run: list[int] = []

    def flush() -> None:
        if run:
            out.extend(tokenizer.encode(enc.decode_utf8(run)))
            run.clear()

    for i in harmony_ids:
        if enc.is_special_token(i):
            flush()
            text = enc.decode_utf8([i])
            model_id = tokenizer.special_id(text)
            if model_id is None:
                raise ValueError(f"the model's tokenizer has no {text} token")
            out.append(model_id)
        else:
            run.append(i)
    flush()
    return out


class ChannelReader:
    """Splits a harmony answer's tokens into reasoning (the analysis channel), answer text and, with
    ``calls``, tool calls, as they come.

    The answer starts inside the assistant's header (the prompt ended with ``<|start|>assistant``): the
    header, up to ``<|message|>``, names the channel (after ``<|channel|>``) and may name a recipient
    (``to=functions.NAME``, before or after the channel). Message text goes to the reasoning or the answer
    by channel; with ``calls``, a message to ``functions.NAME`` is a call of NAME whose text is its
    arguments, complete when the message ends (``<|call|>``, or ``<|end|>``). ``<|start|>`` opens the next
    header. Each part is decoded as UTF-8 incrementally, so a character split across tokens comes out whole."""

    def __init__(self, tokenizer: TokenSource, calls: bool = False) -> None:
        self._tok = tokenizer
        self._read_calls = calls
        self._in_message = False
        self._channel = ""
        self._call: str | None = None  # the function the open message calls
        self._header: list[str] = []
        self._header_bytes = bytearray()
        self._reasoning = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._answer = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._arguments = bytearray()
        self.calls: list[ToolCall] = []  # the calls completed so far

    def feed(self, token_ids: Sequence[int]) -> tuple[str, str]:
        """(reasoning, answer) text these tokens add."""
        reasoning: list[str] = []
        answer: list[str] = []
        for token in token_ids:
            raw = self._tok.token_bytes(token)
            if self._tok.is_special(token):
                self._control(raw.decode("utf-8", errors="replace"))
            elif not self._in_message:
                self._header_bytes += raw
            elif self._call is not None:
                self._arguments += raw
            elif self._channel == REASONING_CHANNEL:
                reasoning.append(self._reasoning.decode(raw))
            else:
                answer.append(self._answer.decode(raw))
        return "".join(reasoning), "".join(answer)

    def _control(self, text: str) -> None:
        if not self._in_message and text != "<|start|>":
            self._header += [self._header_bytes.decode("utf-8", errors="replace"), text]
            self._header_bytes = bytearray()
        if text == "<|message|>" and not self._in_message:
            header = "".join(self._header)
            channel = _CHANNEL.search(header)
            recipient = _RECIPIENT.search(header)
            self._channel = channel.group(1) if channel else ""
            name = recipient.group(1) if recipient else ""
            self._call = name[len(CALL_PREFIX) :] if self._read_calls and name.startswith(CALL_PREFIX) else None
            self._in_message, self._header = True, []
        elif text in ("<|end|>", "<|start|>", *TURN_ENDS):
            if self._call is not None:
                arguments = self._arguments.decode("utf-8", errors="replace").strip()
                self.calls.append(ToolCall(new_call_id(), self._call, arguments or "{}"))
            self._in_message, self._channel, self._call = False, "", None
            self._header, self._header_bytes, self._arguments = [], bytearray(), bytearray()
