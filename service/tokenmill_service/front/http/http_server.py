"""uvicorn serving the HTTP API on the server's own event loop, its log lines through structlog."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from typing import Any

import structlog
import uvicorn

from tokenmill_service.front.http.http_api import HttpApi

log = structlog.get_logger("tokenmill.http")


class _ToStructlog(logging.Handler):
    """uvicorn logs through the standard library; its lines go out through structlog like ours."""

    def emit(self, record: logging.LogRecord) -> None:
        log.log(record.levelno, "uvicorn", message=record.getMessage(), exc_info=record.exc_info or None)


class _Server(uvicorn.Server):
    # The server process owns SIGTERM/SIGINT (draining); uvicorn must not take them over.
    @contextlib.contextmanager
    def capture_signals(self) -> Any:
        yield


class HttpServer:
    """uvicorn on a socket bound up front (so a taken port fails start-up like the gRPC port does)."""

    def __init__(self, api: HttpApi, host: str, port: int) -> None:
        self.sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.port = int(self.sock.getsockname()[1])
        uvicorn_log = logging.getLogger("uvicorn")
        uvicorn_log.handlers = [_ToStructlog()]
        uvicorn_log.setLevel(logging.WARNING)
        uvicorn_log.propagate = False
        config = uvicorn.Config(api.app, log_config=None, access_log=False, lifespan="off", timeout_graceful_shutdown=1)
        self.server = _Server(config)
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.task = asyncio.ensure_future(self.server.serve(sockets=[self.sock]))

    async def stop(self) -> None:
        self.server.should_exit = True
        if self.task is not None:
            await self.task
        self.sock.close()
