"""`tokenmill-server`: the gRPC server, its workers, health, reflection, metrics and draining."""

from __future__ import annotations

import asyncio
import ipaddress
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tokenmill_service import __version__
from tokenmill_service.contract.config import Settings, load_settings
from tokenmill_service.contract.log_setup import configure_logging
from tokenmill_service.contract.tokenizer import Tokenizer
from tokenmill_service.front import worker_processes
from tokenmill_service.front.banner import show_ready_banner
from tokenmill_service.front.metrics import Metrics
from tokenmill_service.front.proto import pb
from tokenmill_service.front.reflection import enable_reflection
from tokenmill_service.front.router import Router, WorkerStartError
from tokenmill_service.front.server import GenerationServicer, adapter_state, add_generation_servicer, engine_totals

if TYPE_CHECKING:
    from tokenmill_service.front.http.http_server import HttpServer

log = structlog.get_logger("tokenmill.main")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name


class StartRefused(Exception):
    """Start-up cannot go on (the reason is logged): the process exits with ``exit_code``."""

    def __init__(self, exit_code: int) -> None:
        super().__init__(exit_code)
        self.exit_code = exit_code


async def serve(settings: Settings) -> int:
    if settings.node_rank > 0:
        # A node above 0 of a replica spanning servers runs its ranks only.
        from tokenmill_service.front.follower_node import serve_follower_node

        return await serve_follower_node(settings)
    try:
        model_path = checked_model_path(settings)
    except StartRefused as exc:
        return exc.exit_code
    signals = StopSignals()
    # The workers start (seconds: their imports, the weights) while this process reads the tokenizer (about a
    # second for a 128k vocabulary); a failure here kills them, so what is refused is refused as before.
    metrics = Metrics()
    router = Router(settings, metrics)
    starting = asyncio.ensure_future(router.start())
    try:
        tokenizer = await load_chat_tokenizer(settings, model_path)
        metrics.bind_state(lambda: engine_totals(router))
        metrics.bind_adapters(lambda: adapter_state(router, settings.max_loras))
        servers = Servers.bind(settings, router, tokenizer, metrics)
    except StartRefused as exc:
        starting.cancel()
        router.kill()
        return exc.exit_code
    if not settings.auth_tokens() and not loopback(settings.host):
        log.warning(
            "listening_without_auth",
            host=settings.host,
            message="anyone who reaches this address can generate: set --auth-token or --auth-token-file, "
            "or listen on 127.0.0.1 behind a proxy that authenticates",
        )
    await servers.start(settings, metrics, model_path, router)
    exit_code = await run_until_stopped(settings, servers, router, metrics, starting, signals.stop)
    return await drain(settings, servers, router, signals, exit_code)


def checked_model_path(settings: Settings) -> Path:
    """The model to serve, found, and the parallel degrees asked for checked against it (StartRefused)."""
    from tokenmill_service.contract.model_paths import ModelNotFoundError, resolve_model_path

    try:
        model_path = resolve_model_path(settings.model or None)
    except (ModelNotFoundError, FileNotFoundError, ValueError) as exc:
        log.error("model_unavailable", error=str(exc))
        raise StartRefused(1) from None
    if settings.tensor_parallel > 1 or settings.expert_parallel:
        try:
            check_tensor_parallel(settings, model_path)
        except ValueError as exc:
            # A usage error, known before any worker starts: the same exit code as a bad flag.
            log.error("tensor_parallel_refused", error=str(exc))
            sys.stderr.write(f"tokenmill-server: error: {exc}\n")
            raise StartRefused(2) from None
    return model_path


class StopSignals:
    """The first SIGTERM or SIGINT drains (``stop``); a second one, during the drain, stops at once (``stop_now``)."""

    def __init__(self) -> None:
        self.stop = asyncio.Event()
        self.stop_now = asyncio.Event()
        self.received: list[signal.Signals] = []
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)

    def _on_signal(self, sig: signal.Signals) -> None:
        self.received.append(sig)
        (self.stop_now if self.stop.is_set() else self.stop).set()


async def load_chat_tokenizer(settings: Settings, model_path: Path) -> Tokenizer:
    """The model's tokenizer, with --chat-template's template where given (StartRefused when unreadable)."""
    from tokenmill_service.contract.model_paths import ModelNotFoundError
    from tokenmill_service.contract.tokenizer import load_tokenizer

    try:
        tokenizer = await asyncio.to_thread(load_tokenizer, model_path)
        template = settings.chat_template_source()
        if template is not None:
            # Chats are rendered here, in the server process; the workers never render one.
            tokenizer.chat_template = template
    except (ModelNotFoundError, FileNotFoundError, ValueError) as exc:
        log.error("model_unavailable", error=str(exc))
        raise StartRefused(1) from None
    if tokenizer.harmony:
        from tokenmill_service.contract.chat import harmony

        try:  # loaded now (a second or two), so that the first chat request does not wait for it
            harmony.encoding()
        except harmony.HarmonyUnavailable as exc:
            log.warning("harmony_chats_refused", reason=str(exc))
    return tokenizer


@dataclass
class Servers:
    """What this process serves: the gRPC server with health and reflection, the plaintext health server
    (--health-port), the HTTP API (--http-port)."""

    server: grpc.aio.Server
    servicer: GenerationServicer
    health_servicer: Any
    health_server: grpc.aio.Server | None
    http_server: HttpServer | None
    address: str

    @classmethod
    def bind(cls, settings: Settings, router: Router, tokenizer: Tokenizer, metrics: Metrics) -> Servers:
        """Every server built and its port bound (StartRefused: a port taken, TLS files unreadable)."""
        server = grpc.aio.server(
            options=[("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", settings.request_bytes_limit)]
        )
        servicer = GenerationServicer(settings, router, tokenizer, metrics)
        add_generation_servicer(servicer, server)
        health_servicer = health.aio.HealthServicer()  # type: ignore[attr-defined]  # (grpc-stubs' health.pyi has no aio)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        enable_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name),
            server,
            servicer.service.authorized if settings.auth_tokens() else None,
        )
        address = f"{settings.host}:{settings.port}"
        try:
            credentials = server_credentials(settings)
            if credentials is None:
                server.add_insecure_port(address)
            else:
                server.add_secure_port(address, credentials)
        except OSError as exc:
            log.error("cannot_read_tls_files", error=str(exc))
            raise StartRefused(1) from None
        except RuntimeError as exc:
            log.error("cannot_listen", address=address, error=str(exc))
            raise StartRefused(1) from None
        http_server = None
        if settings.http_port:
            from tokenmill_service.front.http.http_api import HttpApi
            from tokenmill_service.front.http.http_server import HttpServer

            try:
                http_server = HttpServer(HttpApi(servicer.service), settings.host, settings.http_port)
            except OSError as exc:
                log.error("cannot_listen", address=f"{settings.host}:{settings.http_port}", error=str(exc))
                raise StartRefused(1) from None
        return cls(server, servicer, health_servicer, None, http_server, address)

    async def set_health(self, status: int) -> None:
        for name in ("", SERVICE_NAME):
            await self.health_servicer.set(name, status)

    async def start(self, settings: Settings, metrics: Metrics, model_path: Path, router: Router) -> None:
        """Serve, NOT_SERVING until the workers are ready."""
        # Probes that cannot speak TLS (kubelet's) get the health service alone, in plaintext, on its own port.
        if settings.health_port:
            self.health_server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
            health_pb2_grpc.add_HealthServicer_to_server(self.health_servicer, self.health_server)
            self.health_server.add_insecure_port(f"{settings.host}:{settings.health_port}")
            await self.health_server.start()
        await self.set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.start()
        if self.http_server is not None:
            self.http_server.start()
        if settings.metrics_port:
            guard = None if settings.metrics_without_auth else self.servicer.service.authorized
            metrics.serve(settings.metrics_port, settings.host, guard)
        log.info(
            "server_listening",
            address=self.address,
            tls="mutual" if settings.tls_client_ca else bool(settings.tls_cert),
            model=str(model_path),
            workers=router.num_workers,
            device=settings.device,
            metrics_port=settings.metrics_port or None,
            http_port=settings.http_port or None,
        )

    async def stop(self, grace: float | None) -> None:
        """Stop listening (the gRPC server lets its calls finish within ``grace`` seconds)."""
        await self.server.stop(grace=grace)
        if self.health_server is not None:
            await self.health_server.stop(grace=None)
        if self.http_server is not None:
            await self.http_server.stop()


async def run_until_stopped(
    settings: Settings,
    servers: Servers,
    router: Router,
    metrics: Metrics,
    starting: asyncio.Future[None],
    stop: asyncio.Event,
) -> int:
    """Serve once the workers are ready, until a signal; the exit code so far (the workers' start failed: 1, or
    2 where the model or the flags cannot be served as asked)."""
    stopping = asyncio.ensure_future(stop.wait())
    either: set[asyncio.Future[Any]] = {starting, stopping}
    await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():
        starting.cancel()
        return 0
    failure = starting.exception()
    if failure is None:
        await servers.set_health(health_pb2.HealthCheckResponse.SERVING)
        info = next(w.info for w in router.workers if w.info is not None)
        metrics.set_build_info(__version__, info.model_name, settings.backend, info.dtype, info.quantization)
        metrics.bind_endpoint_picker(
            lambda: engine_totals(router),
            servers.servicer.service.model_name(),
            info.kv_block_size,
            sum(w.info.kv_blocks_total for w in router.workers if w.info is not None),
        )
        watcher = asyncio.ensure_future(follow_workers(router, servers.set_health))
        log.info("server_ready", address=servers.address, http_port=settings.http_port or None)
        # The commands to try, plain and copy-pasteable (not inside a log line): on a terminal, or as --banner says.
        show_ready_banner(settings, info.model_name)
        await stopping
        watcher.cancel()
        return 0
    log.error(
        "workers_failed_to_start",
        error=str(failure) if isinstance(failure, WorkerStartError) else repr(failure),
    )
    if isinstance(failure, WorkerStartError) and failure.usage:
        # The model or the flags cannot be served as asked: the same exit code as a bad flag.
        sys.stderr.write(f"tokenmill-server: error: {failure}\n")
        return 2
    return 1


async def drain(settings: Settings, servers: Servers, router: Router, signals: StopSignals, exit_code: int) -> int:
    """Refuse new calls, let in-flight ones finish within drain_seconds, then exit; a second signal meanwhile
    stops at once (exit code 128 + the signal's number)."""
    log.info(
        "draining",
        signal=signals.received[0].name if signals.received else None,
        drain_seconds=settings.drain_seconds,
        in_flight=router.inflight_count(),
        hint="send SIGINT (Ctrl-C) or SIGTERM again to stop at once",
    )

    async def shut_down() -> None:
        router.draining = True
        await servers.set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        await router.drain(settings.drain_seconds)
        await servers.stop(grace=1.0)
        await router.stop()

    shutting_down = asyncio.ensure_future(shut_down())
    interrupted = asyncio.ensure_future(signals.stop_now.wait())
    await asyncio.wait({shutting_down, interrupted}, return_when=asyncio.FIRST_COMPLETED)
    if not shutting_down.done():
        shutting_down.cancel()
        # A second signal: no more waiting for calls or workers; kill the workers and go.
        sig = signals.received[-1]
        log.warning("stopping_now", signal=sig.name, in_flight=router.inflight_count())
        router.kill()
        await servers.stop(grace=None)
        exit_code = 128 + sig.value
    else:
        interrupted.cancel()
        shutting_down.result()
    log.info("server_stopped", exit_code=exit_code)
    return exit_code


def loopback(host: str) -> bool:
    """Whether ``host`` (--host) is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_tensor_parallel(settings: Settings, model_path: Path) -> None:
    """Refuse a --tensor-parallel degree that does not split the model, or --expert-parallel on a model
    without experts or experts the degree does not divide (ValueError naming the degrees that do)."""
    from tokenmill_service.contract.model_dims import read_dims
    from tokenmill_service.contract.parallel_degree import check_degree

    # GGUF tensors are split in whole blocks (read_dims finds the largest); int4 quantizes in groups of 32.
    check_degree(
        read_dims(model_path),
        settings.tensor_parallel,
        int4_groups=settings.quantization == "int4",
        expert_parallel=settings.expert_parallel,
    )


def server_credentials(settings: Settings) -> grpc.ServerCredentials | None:
    """TLS credentials from --tls-cert/--tls-key (and --tls-client-ca: mutual TLS); None for plaintext."""
    if not settings.tls_cert:
        return None

    def read(path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    key_pair = [(read(settings.tls_key), read(settings.tls_cert))]
    if settings.tls_client_ca:
        return grpc.ssl_server_credentials(
            key_pair, root_certificates=read(settings.tls_client_ca), require_client_auth=True
        )
    return grpc.ssl_server_credentials(key_pair)


async def follow_workers(router: Router, set_health: Callable[[int], Awaitable[None]]) -> None:
    """NOT_SERVING while no worker can take a call (all dead, hung, restarting); SERVING again after."""
    serving = True
    while True:
        # The router signals each change at once; the timeout is a safety net.
        try:
            await asyncio.wait_for(router.state_changed.wait(), 0.5)
        except asyncio.TimeoutError:
            pass
        router.state_changed.clear()
        if router.ready != serving:
            serving = router.ready
            status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
            await set_health(status)
            log.warning("health_changed", serving=serving)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        settings = load_settings(argv)
    except ValueError as exc:
        sys.stderr.write(f"tokenmill-server: error: {exc}\n")
        return 2
    configure_logging(settings.resolved_log_format(), settings.log_level)
    try:
        return asyncio.run(serve(settings))
    finally:
        worker_processes.stop_helpers()  # nothing this process started outlives it


if __name__ == "__main__":
    sys.exit(main())
