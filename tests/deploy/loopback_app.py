"""An aiohttp application on loopback, served by an event loop in a thread of its own (so a benchmark
subprocess can reach it too): the peers' stand-ins in the bench tests."""

from __future__ import annotations

import asyncio
import threading

from aiohttp import web


class LoopbackApp:
    """Serves ``app`` on 127.0.0.1 at a free port (``url``) between ``start`` and ``stop``."""

    def __init__(self, app: web.Application) -> None:
        self.app = app
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None

    def start(self) -> None:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)

    async def _start(self) -> None:
        self._runner = web.AppRunner(self.app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"

    def stop(self) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
