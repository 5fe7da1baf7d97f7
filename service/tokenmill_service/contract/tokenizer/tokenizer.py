"""The Tokenizer: encode, decode and chat-render for one model, whichever files it was read from.

Control tokens are the encoding's special tokens; plain-text encoding never produces them, whatever
the text says. Chat prompts are the one place control tokens are parsed, and only where the chat
template, not a message, wrote them.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Collection, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from functools import cached_property
from typing import Any, Protocol

from tokenmill_service.contract.chat import harmony
from tokenmill_service.contract.chat.chat_template import ChatTemplate
from tokenmill_service.contract.chat.harmony_response_format import ResponseFormat

# Tokens that end a turn or a document: generation stops on them as it does on EOS.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|endoftext|>", "<|end|>", "<end_of_turn>")

# Put inside a special-token string found in message content so it no longer matches; a
# noncharacter, and doubled where content already holds it, so the mark is always reversible.
_MARK = "\ufdd0"
_UNMARK = re.compile(f"{_MARK}({_MARK})?")


class TokenizerError(ValueError):
    """The tokenizer files describe a tokenizer this service does not support."""


class Encoding(Protocol):
    """What the Tokenizer asks of the encoding a reader builds (a tiktoken.Encoding for byte-level BPE, a
    SentencePieceEncoding for SentencePiece)."""

    def encode(self, text: str, *, allowed_special: AbstractSet[str], disallowed_special: Collection[str]) -> list[int]:
        """Text to ids, parsing the special tokens in ``allowed_special``; ValueError where the text holds one in
        ``disallowed_special``, and any other special token's text stays text."""

    def encode_ordinary(self, text: str) -> list[int]:
        """Text to ids, parsing no special token."""

    def decode_bytes(self, tokens: Sequence[int]) -> bytes:
        """The ids' bytes together (less the space a SentencePiece encoding put in front of the text); KeyError
        for an id with no token."""

    def decode_single_token_bytes(self, token: int) -> bytes:
        """One token's bytes (a special token's are its text's UTF-8); KeyError for an id with no token."""


class Tokenizer:
    """Encode, decode and chat-render for one model; the engine and the service only use this class."""

    def __init__(
        self,
        encoding: Encoding,
        *,
        vocab_size: int,
        special_tokens: Mapping[str, int],
        added_tokens: Mapping[str, int],
        eos_token_id: int,
        bos_token_id: int | None,
        add_bos: bool,
        chat_template: str | None,
        nfc: bool = False,
        extra_stop_ids: Iterable[int] = (),
    ) -> None:
        self._enc = encoding
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.bos_token_id = bos_token_id
        self.add_bos = add_bos
        self.chat_template = chat_template
        self._nfc = nfc
        # Control tokens: never parsed from plain text, carry no text in generated output.
        self._special_by_text = dict(special_tokens)
        self._special_ids = frozenset(special_tokens.values())
        # User-defined added tokens (e.g. "<tool_call>"): parsed from text and shown as text.
        self._added_texts = frozenset(added_tokens)
        # A harmony model (gpt-oss) ends its turn with <|return|> or <|call|>; its <|end|> ends a message.
        self.harmony = harmony.is_harmony(frozenset(special_tokens))
        turn_ends = harmony.TURN_ENDS if self.harmony else END_OF_TURN_TOKENS
        end_of_turn = [i for t, i in [*special_tokens.items(), *added_tokens.items()] if t in turn_ends]
        self._stop_ids = frozenset({eos_token_id, *extra_stop_ids, *end_of_turn})
        self._bos_text = None if bos_token_id is None else self.token_text(bos_token_id)
        self._eos_text = self.token_text(eos_token_id)
        by_length = sorted(special_tokens, key=len, reverse=True)
        self._special_re = re.compile("|".join(map(re.escape, by_length))) if by_length else None

    # -- tokens ------------------------------------------------------------------------------

    @property
    def stop_token_ids(self) -> frozenset[int]:
        return self._stop_ids

    def encode(self, text: str) -> list[int]:
        """Plain text to ids: no BOS, and special-token text stays text."""
        if self._nfc:
            text = unicodedata.normalize("NFC", text)
        if self._added_texts:
            ids = self._enc.encode(text, allowed_special=self._added_texts, disallowed_special=())
        else:
            ids = self._enc.encode_ordinary(text)
        limit = self.vocab_size
        # Ids at or past the vocabulary stand for bytes the model has no token for.
        return ids if not ids or max(ids) < limit else [i for i in ids if i < limit]

    def decode(self, ids: Sequence[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        if ids and min(ids) >= 0 and max(ids) < self.vocab_size:
            try:
                return self._enc.decode_bytes(ids)
            except KeyError:
                pass  # an id with no token (a gap in the vocabulary): fall back to one at a time
        return b"".join(self.token_bytes(i) for i in ids)

    def token_bytes(self, token_id: int) -> bytes:
        """A token's bytes; a special token's are its text's UTF-8, an id with no token has none."""
        if not 0 <= token_id < self.vocab_size:
            return b""
        try:
            return self._enc.decode_single_token_bytes(token_id)
        except KeyError:
            return b""

    def token_text(self, token_id: int) -> str:
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def special_id(self, text: str) -> int | None:
        """The id of the control token written ``text`` (None: there is none)."""
        return self._special_by_text.get(text)

    # -- chat --------------------------------------------------------------------------------

    @cached_property
    def _chat(self) -> ChatTemplate:
        # Compiled on first use, so a broken template only fails chat requests, not loading.
        return ChatTemplate(self.chat_template, bos_token=self._bos_text, eos_token=self._eos_text)

    @property
    def chat_roles(self) -> frozenset[str]:
        """Roles this model's chat template accepts."""
        return self._chat.roles

    def validate_messages(self, messages: Sequence[Mapping[str, str]]) -> None:
        """Raise ``ValueError`` (naming the role) for a message the chat template cannot take."""
        self._chat.validate_messages(messages)

    def render_chat(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> str:
        return self._chat.render(messages, add_generation_prompt)

    @property
    def chat(self) -> ChatTemplate:
        return self._chat

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        response_format: ResponseFormat | None = None,
    ) -> list[int]:
        """The prompt ids: the template's special tokens as special ids, message text always as text
        (``tools``: OpenAI-shaped tool definitions, for templates that render them). A harmony model's
        conversations are rendered by openai-harmony instead (harmony.py), with ``response_format`` (the JSON
        schema the answer must match) described in the developer message; other chat templates have no
        place for it and leave it out."""
        if self.harmony:
            self._chat.validate_messages(messages)  # string roles and contents
            return harmony.render(messages, self, tools, response_format)
        self._chat.validate_messages(messages)
        rendered = self._chat.render([self._mark_message(m) for m in messages], add_generation_prompt, tools)
        ids: list[int] = []
        pos = 0
        if self._special_re is not None:
            for match in self._special_re.finditer(rendered):
                ids += self.encode(_unmark(rendered[pos : match.start()]))
                ids.append(self._special_by_text[match.group()])
                pos = match.end()
        ids += self.encode(_unmark(rendered[pos:]))
        if self.add_bos and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)
        return ids

    def _mark_message(self, message: Mapping[str, Any]) -> dict[str, Any]:
        return {key: self._mark(value) if isinstance(value, str) else value for key, value in message.items()}

    def _mark(self, text: str) -> str:
        """``text`` with every special-token string broken by a mark that ``_unmark`` removes."""
        text = text.replace(_MARK, _MARK + _MARK)
        if self._special_re is None:
            return text
        # Inside the string, so templates that trim content keep the mark; repeated because one
        # special-token string may hide inside another's remains.
        while self._special_re.search(text):
            text = self._special_re.sub(lambda m: m.group()[0] + _MARK + m.group()[1:], text)
        return text


def _unmark(text: str) -> str:
    return _UNMARK.sub(lambda m: m.group(1) or "", text) if _MARK in text else text
