"""vLLM's `/tokenize` and `/detokenize` bodies (lm-evaluation-harness tokenizes through them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenmill_service.front.http.openai_protocol import read_messages
from tokenmill_service.front.http.request_fields import BadRequest, boolean, check_model, is_token_ids, json_object
from tokenmill_service.front.proto import pb


@dataclass(slots=True)
class TokenizeBody:
    """A /tokenize body: text (with BOS when the model adds one and add_special_tokens) or a chat."""

    prompt: str | None
    chat: pb.Messages | None
    add_special_tokens: bool
    add_generation_prompt: bool
    return_token_strs: bool


def parse_tokenize(body: Any) -> TokenizeBody:
    """A /tokenize body: exactly one of a prompt and a chat."""
    body = json_object(body)
    check_model(body)
    prompt, messages = body.get("prompt"), body.get("messages")
    if (prompt is None) == (messages is None):
        raise BadRequest("give exactly one of 'prompt' (a string) and 'messages' (a chat)", "prompt")
    if prompt is not None and not isinstance(prompt, str):
        raise BadRequest("'prompt' must be a string", "prompt")

    def flag(name: str, default: bool) -> bool:
        return default if body.get(name) is None else boolean(body, name)

    return TokenizeBody(
        prompt=prompt,
        chat=None if messages is None else read_messages(messages),
        # vLLM's defaults: special tokens for text, none beyond the template's for a chat.
        add_special_tokens=flag("add_special_tokens", prompt is not None),
        add_generation_prompt=flag("add_generation_prompt", True),
        return_token_strs=flag("return_token_strs", False),
    )


def parse_detokenize(body: Any) -> list[int]:
    """A /detokenize body's token ids (their range is checked against the vocabulary by the route)."""
    body = json_object(body)
    check_model(body)
    tokens = body.get("tokens")
    if not is_token_ids(tokens):
        raise BadRequest("'tokens' must be a list of token ids", "tokens")
    if tokens and min(tokens) < 0:
        raise BadRequest("'tokens' must be token ids >= 0", "tokens")
    return tokens
