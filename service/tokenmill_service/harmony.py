"""The harmony chat format (gpt-oss): conversations rendered with openai's ``openai-harmony`` package, and
the answer's channels read back token by token.

A harmony model's tokenizer has harmony's control tokens (``<|start|>``, ``<|channel|>``,
``<|message|>``, ``<|end|>``, ``<|return|>``, ``<|call|>``); such a tokenizer renders chats here instead
of with a Jinja template. A message is ``<|start|>{role}<|channel|>{channel}<|message|>{text}<|end|>``;
the model answers in the ``analysis`` channel (its reasoning), then the ``final`` one (the answer),
ending with ``<|return|>`` (or ``<|call|>`` for a tool call), so ``<|end|>`` does not end the turn.

- Rendering: the OpenAI-style messages become a harmony ``Conversation`` (a default system message; the
  caller's "system" / "developer" messages as the developer's instructions; user and assistant turns, the
  latter in the final channel) and ``render_conversation_for_completion`` gives harmony's ids. Its control
  tokens map to the model's by text, and the text between them is encoded with the model's tokenizer (for
  gpt-oss's own o200k vocabulary the ids are the same), so message text never becomes a control token.
- Reading: ``ChannelReader`` follows the generated tokens: the analysis channel's text is the reasoning
  (``reasoning_content`` over HTTP, ``reasoning_text`` over gRPC), every other channel's the answer.

openai-harmony reads the o200k_base vocabulary from the directory ``TIKTOKEN_ENCODINGS_BASE`` names (it
would download it otherwise); ``make tools`` writes it to ``.tools/tiktoken/`` from npm's js-tiktoken,
checked against its published SHA-256 (scripts/install_tools.sh).
"""

from __future__ import annotations

import codecs
import os
from collections.abc import Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import Any, Protocol

CONTROL = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>")
# Tokens that end a harmony turn (``<|end|>`` ends only a message).
TURN_ENDS = ("<|return|>", "<|call|>")
REASONING_CHANNEL = "analysis"
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


def render(messages: Sequence[Mapping[str, Any]], tokenizer: TokenSource) -> list[int]:
    """The prompt ids of an OpenAI-style conversation, up to the assistant's turn (``<|start|>assistant``)."""
    import openai_harmony as oh

    enc = encoding()
    conversation = [oh.Message.from_role_and_content(oh.Role.SYSTEM, oh.SystemContent.new())]
    for i, message in enumerate(messages):
        role, content = message["role"], str(message.get("content") or "")
        if role in ("system", "developer"):
            developer = oh.DeveloperContent.new().with_instructions(content)
            conversation.append(oh.Message.from_role_and_content(oh.Role.DEVELOPER, developer))
        elif role == "user":
            conversation.append(oh.Message.from_role_and_content(oh.Role.USER, content))
        elif role == "assistant":
            answer = oh.Message.from_role_and_content(oh.Role.ASSISTANT, content).with_channel("final")
            conversation.append(answer)
        else:
            raise ValueError(f"message {i} has role {role!r}, which the harmony format does not take here")
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
    """Splits a harmony answer's tokens into reasoning (the analysis channel) and answer text, as they come.

    The answer starts inside the assistant's header (the prompt ended with ``<|start|>assistant``): header
    text up to ``<|message|>`` names the channel (after ``<|channel|>``); message text goes to the reasoning
    or the answer by channel; ``<|end|>`` ends a message, ``<|start|>`` opens the next header. Each part is
    decoded as UTF-8 incrementally, so a character split across tokens comes out whole."""

    def __init__(self, tokenizer: TokenSource) -> None:
        self._tok = tokenizer
        self._in_message = False
        self._channel = ""
        self._header = bytearray()
        self._reading_channel = False
        self._reasoning = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._answer = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_ids: Sequence[int]) -> tuple[str, str]:
        """(reasoning, answer) text these tokens add."""
        reasoning: list[str] = []
        answer: list[str] = []
        for token in token_ids:
            raw = self._tok.token_bytes(token)
            if self._tok.is_special(token):
                self._control(raw.decode("utf-8", errors="replace"))
            elif self._in_message:
                if self._channel == REASONING_CHANNEL:
                    reasoning.append(self._reasoning.decode(raw))
                else:
                    answer.append(self._answer.decode(raw))
            elif self._reading_channel:
                self._header += raw
        return "".join(reasoning), "".join(answer)

    def _control(self, text: str) -> None:
        if text == "<|channel|>":
            self._reading_channel, self._header = True, bytearray()
        elif text in ("<|message|>",):
            self._channel = self._header.decode("utf-8", errors="replace").split()[0] if self._header.strip() else ""
            self._reading_channel, self._in_message = False, True
        elif text == "<|constrain|>":
            self._reading_channel = False
        elif text in ("<|end|>", "<|start|>", *TURN_ENDS):
            self._in_message, self._reading_channel, self._channel = False, False, ""
