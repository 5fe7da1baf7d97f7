"""A request's body, read only up to --max-request-bytes."""

from __future__ import annotations

from starlette.requests import Request

from tokenmill_service.front.http.request_fields import BadRequest


class BodyTooLarge(BadRequest):
    """A request body over --max-request-bytes (413)."""

    def __init__(self, limit: int) -> None:
        super().__init__(
            f"the request body is over this server's limit of {limit} bytes (--max-request-bytes)",
            code="request_too_large",
        )


# A body over the limit is read to its end and dropped (no copy kept, nothing parsed) up to this size, so that the
# client, still sending, reads the 413 rather than a reset connection; a larger one is cut off.
DRAIN_BYTES = 64 * 1024 * 1024


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body, refused (BodyTooLarge) once it is known to pass ``limit`` bytes: by its
    Content-Length or as it arrives. Only up to ``limit`` bytes are ever kept."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max(limit, DRAIN_BYTES):
        raise BodyTooLarge(limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > DRAIN_BYTES:
            break
        if size <= limit:
            chunks.append(chunk)
    if size > limit:
        raise BodyTooLarge(limit)
    return b"".join(chunks)
