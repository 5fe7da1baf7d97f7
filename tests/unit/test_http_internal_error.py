"""A bug in a route (here: a service whose tokenizer cannot be read) is a 500 in OpenAI's JSON shape, logged
with its traceback: it was uvicorn's plain-text "Internal Server Error" and a log line without the cause."""

from __future__ import annotations

from typing import Any, cast

from starlette.testclient import TestClient
from structlog.testing import capture_logs

from tokenmill_service.front.generation import GenerationService
from tokenmill_service.front.http.http_api import HttpApi


class BrokenService:
    """Just enough of a GenerationService for /tokenizer_info to reach its tokenizer, which fails."""

    def authorize(self, authorization: str | None, where: str) -> None:
        pass

    @property
    def tokenizer(self) -> Any:
        raise RuntimeError("the tokenizer went away")


def test_an_internal_error_is_a_json_500_logged_with_its_traceback() -> None:
    api = HttpApi(cast(GenerationService, BrokenService()))
    with capture_logs() as logs, TestClient(api.app, raise_server_exceptions=False) as client:
        reply = client.get("/tokenizer_info")
    assert reply.status_code == 500
    assert reply.json()["error"]["code"] == "internal_error" and "RuntimeError" in reply.json()["error"]["message"]
    (line,) = [entry for entry in logs if entry["event"] == "http_internal_error"]
    assert line["path"] == "/tokenizer_info" and "the tokenizer went away" in line["error"]
    assert isinstance(line["exc_info"], RuntimeError)
