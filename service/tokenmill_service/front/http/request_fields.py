"""A JSON request body's fields read one by one, each refused with a 400 (``BadRequest``) that names it.

What every HTTP dialect's parser shares (openai_protocol.py, tokenize_protocol.py and the APIs served through the
chat path): the body is an object, a field is a number, an integer in range, a boolean, the model a string.
"""

from __future__ import annotations

import math
from typing import Any, TypeGuard


class BadRequest(ValueError):
    """A body that is not a valid OpenAI request; the message names the parameter, `code` says what is wrong."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param = param
        self.code = code


UINT32_MAX = 2**32 - 1


def json_object(body: Any) -> dict[str, Any]:
    """The body, refused unless it is a JSON object."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


def check_model(body: dict[str, Any]) -> None:
    """``model``, where given, is a string (which model it names is the route's business)."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest(f"'model' must be a string; given {model!r}", "model")


def number(body: dict[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise BadRequest(f"'{name}' must be a number; given {value!r}", name)
    return float(value)


def integer(body: dict[str, Any], name: str, minimum: int = 0, maximum: int = UINT32_MAX) -> int | None:
    """An integer field within [minimum, maximum] (the range of the request's field it goes to: uint32 unless
    said), else a 400 naming it."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # (JSON's 5.0 is the integer 5, as JSON Schema and this API's description read it)
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"'{name}' must be an integer; given {value!r}", name)
    if value < minimum:
        raise BadRequest(f"'{name}' must be >= {minimum}; given {value}", name)
    if value > maximum:
        raise BadRequest(f"'{name}' must be <= {maximum}; given {value}", name)
    return value


def boolean(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadRequest(f"'{name}' must be true or false; given {value!r}", name)
    return value


def is_token_ids(value: Any) -> TypeGuard[list[int]]:
    """A list of integers (JSON's true and false are not); which of them are in range is checked where used."""
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def text_of(value: Any, where: str, param: str, kind: str = "part", sep: str = "") -> str:
    """A string, or a list of text {kind}s (``{'type': 'text', 'text': ...}``; their other keys change nothing)
    joined by ``sep``: a message's content (OpenAI's parts, Anthropic's blocks)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for i, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise BadRequest(f"{where}[{i}] must be a text {kind} ({{'type': 'text', 'text': ...}})", param)
            texts.append(part["text"])
        return sep.join(texts)
    raise BadRequest(f"{where} must be a string or a list of text {kind}s", param)
