"""LoRA adapters across the replicas: loading and unloading one on every replica, and checking
that a request's adapter is served.

The served set (``ReplicaPool.adapters``, name -> path) is what every replica starts and restarts
with, so a stream resumed on a restarted replica finds its adapter there. A load goes to every
serving replica and succeeds only where all of them took it (otherwise those that did unload it
again); an unload is refused while any request in flight uses the adapter, so none is broken.
Each load gets a new cache key (``key``): what the router's prefix index chains an adapter's blocks
from, so that a name loaded again never seems to find the blocks of its earlier self (the workers'
prefix caches do not find them either).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from itertools import count

import structlog

from tokenmill_service.contract.messages import AdapterResult, LoadAdapter, UnloadAdapter
from tokenmill_service.front.router.errors import AdapterInUse, AdapterNotFound, AdapterRefused, Unavailable
from tokenmill_service.front.router.replicas import Replica, ReplicaPool

log = structlog.get_logger("tokenmill.router")

# Seconds a replica may take to answer a load (reading and checking the adapter's files).
ANSWER_TIMEOUT_S = 60.0


class Adapters:
    def __init__(self, pool: ReplicaPool, users: Callable[[str], int]) -> None:
        self.pool = pool
        self.users = users  # requests in flight with this adapter
        self._waiting: dict[tuple[int, str, bool], asyncio.Future[AdapterResult]] = {}
        self._lock = asyncio.Lock()
        self._loads = count(1)
        self._generation: dict[str, int] = {}  # name -> its load's number (0: served from the start)

    @property
    def served(self) -> dict[str, str]:
        return self.pool.adapters

    def key(self, name: str) -> str:
        """What the prefix index chains the blocks of a request on adapter ``name`` from ("": the base)."""
        return f"{name}#{self._generation.get(name, 0)}" if name else ""

    def check(self, name: str) -> None:
        """A request's adapter: served, or AdapterNotFound."""
        if name and name not in self.served:
            known = ", ".join(sorted(self.served)) or "none are loaded"
            raise AdapterNotFound(
                f"the model {name!r} does not exist: it is neither the base model nor a loaded LoRA adapter ({known})"
            )

    async def load(self, name: str, path: str) -> None:
        async with self._lock:
            if not name or not path:
                raise AdapterRefused("loading a LoRA adapter needs both lora_name and lora_path")
            if name in self.served:
                raise AdapterRefused(f"the LoRA adapter {name!r} is already loaded (from {self.served[name]})")
            replicas = self.pool.serving()
            if not replicas:
                raise Unavailable("no worker is ready to load the adapter; retry shortly")
            results = await self._ask(replicas, LoadAdapter(name, path))
            failed = [r for r in results if r.error]
            if failed:
                taken = [w for w, r in zip(replicas, results) if not r.error]
                if taken:
                    await self._ask(taken, UnloadAdapter(name))
                raise AdapterRefused(failed[0].error)
            self.served[name] = path
            self._generation[name] = next(self._loads)
            log.info("lora_adapter_loaded", name=name, path=path, replicas=len(replicas))

    async def unload(self, name: str) -> None:
        async with self._lock:
            if name not in self.served:
                raise AdapterNotFound(f"the LoRA adapter {name!r} is not loaded")
            users = self.users(name)
            if users:
                raise AdapterInUse(
                    f"the LoRA adapter {name!r} is in use by {users} request(s); unload it when they finish"
                )
            replicas = self.pool.serving()
            results = await self._ask(replicas, UnloadAdapter(name))
            busy = next((r for r in results if r.kind == "in_use"), None)
            if busy is not None:
                # A request reached a replica meanwhile: the replicas that let it go take it back.
                done = [w for w, r in zip(replicas, results) if not r.error]
                if done:
                    await self._ask(done, LoadAdapter(name, self.served[name]))
                raise AdapterInUse(busy.error)
            del self.served[name]
            log.info("lora_adapter_unloaded", name=name)

    async def _ask(self, replicas: list[Replica], cmd: LoadAdapter | UnloadAdapter) -> list[AdapterResult]:
        load = isinstance(cmd, LoadAdapter)
        loop = asyncio.get_running_loop()
        futures = []
        for w in replicas:
            future: asyncio.Future[AdapterResult] = loop.create_future()
            self._waiting[(w.worker_id, cmd.name, load)] = future
            futures.append(future)
            self.pool.send(w, cmd)
        try:
            return list(await asyncio.wait_for(asyncio.gather(*futures), ANSWER_TIMEOUT_S))
        except asyncio.TimeoutError:
            raise Unavailable(f"a worker did not answer within {ANSWER_TIMEOUT_S:.0f} s; retry") from None
        finally:
            for w in replicas:
                self._waiting.pop((w.worker_id, cmd.name, load), None)

    def on_result(self, replica: Replica, result: AdapterResult) -> None:
        future = self._waiting.get((replica.worker_id, result.name, result.load))
        if future is not None and not future.done():
            future.set_result(result)

    def on_ready(self, replica: Replica) -> None:
        """A replica that started before a load finished: give it what it lacks."""
        have = set(replica.info.adapters) if replica.info is not None else set()
        for name, path in self.served.items():
            if name not in have:
                self.pool.send(replica, LoadAdapter(name, path))
