"""OpenAI's error JSON, and validation's messages in the words of the request the caller sent."""

from __future__ import annotations

import re
from typing import Any


def error_json(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# The GenerateRequest's field paths (what validation's messages name) as OpenAI's API names them;
# any other sampling.* or stopping.* field is one of tokenmill's extras, named by its last part.
_OPENAI_FIELDS = {
    "prompt": "prompt",
    "token_ids.ids": "prompt",
    "chat.messages": "messages",
    "stopping.max_new_tokens": "max_tokens",
    "max_new_tokens": "max_tokens",  # the engine's own messages leave out the "stopping."
    "stopping.stop": "stop",
    "top_logprobs": "top_logprobs",
}
_FIELD_PATH = re.compile(
    r"(?<![\w.'])(?:sampling\.\w+|stopping\.\w+|chat\.messages|token_ids\.ids|top_logprobs|max_new_tokens)\b"
)


def openai_error(message: str, field: str | None, names: dict[str, str] | None = None) -> tuple[str, str | None]:
    """A validation message with each field path it names in the words of the request the caller sent
    (``names``: ParsedRequest.field_names), and the OpenAI ``param`` of the field it is about."""
    known = {**_OPENAI_FIELDS, **(names or {})}
    if "stopping.max_new_tokens" in known:
        known["max_new_tokens"] = known["stopping.max_new_tokens"]

    def name(path: str) -> str:
        return known.get(path) or path.rpartition(".")[2]

    return _FIELD_PATH.sub(lambda m: name(m.group()), message), (name(field) if field else None)
