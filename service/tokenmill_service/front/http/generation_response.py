"""The answer of a generating route: its generation runs while it answers, and its status waits for the first
output, so that a refusal (400, 401, 429, 503, 504) is always a plain error response, never a broken stream. A
client that disconnects cancels its request at once (its connection is watched, not only noticed at the next
write)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Any, TypeVar

from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from tokenmill_service.front.generation import ServiceError
from tokenmill_service.front.http.http_errors import json_error, service_error_json
from tokenmill_service.front.http.openai_response import ResponseBuilder
from tokenmill_service.front.proto import pb

T = TypeVar("T")


class Disconnected(Exception):
    pass


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(receive: Receive, work: Awaitable[T]) -> T:
    """Run `work`, cancelling it (and raising Disconnected) if the client goes away first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            raise Disconnected
        return task.result()
    finally:
        watcher.cancel()
        if not task.done():  # this handler itself was cancelled
            task.cancel()


class GenerationResponse(Response):
    """Runs a request's generation (one per prompt of a completions list) while it answers: the status
    waits for the first output (see module doc)."""

    def __init__(
        self, responses: Sequence[AsyncIterator[pb.GenerateResponse]], builder: ResponseBuilder, request_id: str
    ):
        self.all_responses = responses
        self.builder = builder
        self.headers_ = {"x-request-id": request_id}
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        with contextlib.suppress(Disconnected):
            # One task for the whole generation: its log lines share the request's context variables.
            await until_disconnect(receive, self._respond(scope, receive, send))

    async def _respond(self, scope: Scope, receive: Receive, send: Send) -> None:
        if len(self.all_responses) > 1:
            await self._respond_many(scope, receive, send)
            return
        async with contextlib.aclosing(self.all_responses[0]) as responses:  # type: ignore[type-var]
            try:
                first = await anext(responses)
            except ServiceError as exc:
                await self._error(exc)(scope, receive, send)
                return
            if self.builder.parsed.stream:
                await self._stream(first, responses, send)
                return
            try:
                rest = [r async for r in responses]
            except ServiceError as exc:
                await self._error(exc)(scope, receive, send)
                return
            await JSONResponse(self.builder.whole([[first, *rest]]), headers=self.headers_)(scope, receive, send)

    async def _respond_many(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Several prompts, run side by side (the router batches them); the first failure fails them all."""

        async def collect(stream: AsyncIterator[pb.GenerateResponse]) -> list[pb.GenerateResponse]:
            async with contextlib.aclosing(stream) as responses:  # type: ignore[type-var]
                return [r async for r in responses]

        tasks = [asyncio.ensure_future(collect(r)) for r in self.all_responses]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for task in tasks:  # a failure (or this handler's cancellation) ends the others
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        failed = next((t for t in tasks if not t.cancelled() and t.exception() is not None), None)
        if failed is not None:
            error = failed.exception()
            if not isinstance(error, ServiceError):
                raise error  # type: ignore[misc]
            await self._error(error)(scope, receive, send)
            return
        whole = self.builder.whole([t.result() for t in tasks])
        await JSONResponse(whole, headers=self.headers_)(scope, receive, send)

    def _error(self, exc: ServiceError) -> Response:
        status, body = service_error_json(exc, self.builder.parsed.field_names)
        return json_error(status, self.builder.error_body(status, body), self.headers_)

    async def _stream(
        self, first: pb.GenerateResponse, responses: AsyncIterator[pb.GenerateResponse], send: Send
    ) -> None:
        headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]
        headers += [(k.encode(), v.encode()) for k, v in self.headers_.items()]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        for opening in self.builder.first_chunks():
            await self._send_event(send, opening)
        try:
            # Read to the generator's end (not only to the finish reason) so the request ends as completed.
            async for response in _prepend(first, responses):
                for event in self.builder.events(response):
                    await self._send_event(send, event)
        except ServiceError as exc:
            # The status is sent: an error after it is reported as an event, the way OpenAI's streams do.
            status, body = service_error_json(exc, self.builder.parsed.field_names)
            await self._send_event(send, self.builder.error_event(status, body))
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        for event in self.builder.last_events():
            await self._send_event(send, event)
        await send({"type": "http.response.body", "body": self.builder.STREAM_END, "more_body": False})

    async def _send_event(self, send: Send, event: dict[str, Any]) -> None:
        await send({"type": "http.response.body", "body": self.builder.sse(event), "more_body": True})


async def _prepend(first: T, rest: AsyncIterator[T]) -> AsyncIterator[T]:
    yield first
    async for item in rest:
        yield item
