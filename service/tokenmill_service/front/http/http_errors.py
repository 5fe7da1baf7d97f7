"""The HTTP API's refusals as OpenAI's error JSON: a gRPC status (ServiceError) as its HTTP status, a
body the parser refused (BadRequest) as a 400 (413 when too large)."""

from __future__ import annotations

from typing import Any

import grpc
from starlette.responses import JSONResponse

from tokenmill_service.front.generation import ServiceError
from tokenmill_service.front.http.http_body import BodyTooLarge
from tokenmill_service.front.http.openai_errors import error_json, openai_error
from tokenmill_service.front.http.request_fields import BadRequest

# gRPC status -> (HTTP status, OpenAI error type, OpenAI error code unless the error says a closer one)
_HTTP_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", "invalid_value"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error", "invalid_api_key"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "rate_limit_exceeded"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error", "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error", "timeout"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error", "model_not_found"),
    grpc.StatusCode.FAILED_PRECONDITION: (409, "invalid_request_error", "adapter_in_use"),
}
_SERVER_ERROR = (500, "server_error", "internal_error")


def json_error(status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> JSONResponse:
    """An error body with its status; a 401 names the scheme the caller must use (RFC 9110)."""
    if status == 401:
        headers = {**(headers or {}), "www-authenticate": "Bearer"}
    return JSONResponse(body, status_code=status, headers=headers)


def error_response(
    status: int, kind: str, message: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    return json_error(status, error_json(message, kind, param, code))


def service_error_json(exc: ServiceError, names: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    """The HTTP status and OpenAI error of a failed call. validation.py names the gRPC request's fields;
    the caller is told them by the names it used (``names``: ParsedRequest.field_names)."""
    status, kind, code = _HTTP_ERRORS.get(exc.code, _SERVER_ERROR)
    message, param = openai_error(exc.message, exc.field, names)
    return status, error_json(message, kind, param, exc.reason or code)


def refusal_json(exc: ServiceError | ValueError | RecursionError) -> tuple[int, dict[str, Any]]:
    """The HTTP status and OpenAI error of a request refused before it reached the service."""
    if isinstance(exc, ServiceError):
        return service_error_json(exc)
    if isinstance(exc, BadRequest):
        return 413 if isinstance(exc, BodyTooLarge) else 400, error_json(
            str(exc), "invalid_request_error", exc.param, exc.code
        )
    if isinstance(exc, RecursionError):  # (a body within the size limit can still nest deeper than Python recurses)
        return 400, error_json("the request is nested too deeply", "invalid_request_error", code="invalid_value")
    # A value protobuf refuses, e.g. an integer out of range.
    return 400, error_json(str(exc), "invalid_request_error", code="invalid_value")


def refusal_response(exc: ServiceError | BadRequest) -> JSONResponse:
    """A refused call (its token, its body) as OpenAI's error."""
    return json_error(*refusal_json(exc))
