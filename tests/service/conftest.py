"""Fixtures the service tests share beyond the default server (tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.server_process import ServerProcess
from tests.service.chat_dialects import INSTRUCTIONS, MODEL, QUESTION


@pytest.fixture(scope="module")
def chat_client(server: ServerProcess) -> Iterator[openai.OpenAI]:
    """The openai SDK on the default server."""
    with openai.OpenAI(base_url=server.http_url + "/v1", api_key="none", max_retries=0, timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def france(chat_client: openai.OpenAI) -> Any:
    """QUESTION's greedy answer through /v1/chat/completions, under INSTRUCTIONS as the system message: what the
    Messages and Responses APIs' answers about France are held against."""
    messages: Any = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}]
    return chat_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
