"""An HTTP API that generates through the chat and completions path: how its body becomes a ``ParsedRequest``
(openai_protocol.py), and the ``ResponseBuilder`` (openai_response.py) that shapes its answers and errors.

OpenAI's chat and completions are the first two; the Messages API (anthropic_protocol.py) and the Responses API
(responses_protocol.py) rewrite their bodies as the chat body they mean (``parse_as_chat``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tokenmill_service.front.http.openai_protocol import ParsedRequest, parse_request
from tokenmill_service.front.http.openai_response import ResponseBuilder
from tokenmill_service.front.http.request_fields import BadRequest


@dataclass(frozen=True, slots=True)
class Dialect:
    """One HTTP API that generates through the chat and completions path: how its body becomes a ParsedRequest,
    and the ResponseBuilder that shapes its answers and errors."""

    parse: Callable[[Any], ParsedRequest]
    builder: type[ResponseBuilder] = ResponseBuilder
    # A header that may carry the API key instead of Authorization's bearer token (Anthropic's x-api-key).
    key_header: str | None = None


CHAT = Dialect(lambda body: parse_request(body, chat=True))
COMPLETIONS = Dialect(lambda body: parse_request(body, chat=False))


def renamed(exc: BadRequest, names: dict[str, str]) -> BadRequest:
    """A refusal by parse_request in the words of another API that reads its body through it: each parameter
    of ``names`` (and each field under it) as that API calls it, where the message quotes it and in ``param``."""
    message, param = str(exc), exc.param
    for old, new in sorted(names.items(), key=lambda item: -len(item[0])):
        message = re.sub(rf"'{re.escape(old)}(?=['.\[])", f"'{new}", message)
        if param is not None and (param == old or param.startswith(old + ".")):
            param = new + param[len(old) :]
    return BadRequest(message, param, exc.code)


def parse_as_chat(
    chat_body: Callable[[], dict[str, Any]], params: dict[str, str], fields: dict[str, str]
) -> ParsedRequest:
    """Another API's body read as the chat body it means (``chat_body()``, which may refuse it): each refusal
    with the parameters it names as that API names them (``params``: see ``renamed``), and ``fields`` (the
    GenerateRequest's field paths in that API's words) kept for the refusals validation makes."""
    try:
        parsed = parse_request(chat_body(), chat=True)
    except BadRequest as exc:
        raise renamed(exc, params) from None
    parsed.field_names.update(fields)
    return parsed


def given(body: dict[str, Any], *names: str) -> dict[str, Any]:
    """The fields of ``body`` among ``names`` that are set (neither absent nor null), to pass on as they are."""
    return {name: body[name] for name in names if body.get(name) is not None}
