"""What the tests of the APIs served through the chat path (test_anthropic_messages.py, test_responses_api.py)
share: the question and the tool they ask about, and a plain-HTTP post for what their SDKs will not send (the
greedy chat answer their answers are held against is conftest.py's ``france``)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from tests.server_process import ServerProcess

MODEL = "tokenmill"
INSTRUCTIONS = "Answer in one short sentence."
QUESTION = "What is the capital of France?"
RAIN = "What is the weather in Paris?"
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER_DESCRIPTION = "The weather in a city."


def post(server: ServerProcess, path: str, body: Any) -> tuple[int, Any]:
    """``body`` as JSON to ``path``: the status and the answer's JSON, an error's too."""
    request = urllib.request.Request(
        server.http_url + path, json.dumps(body).encode(), {"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())
