"""`tokenmill-server`: the gRPC server, its workers, health, reflection, metrics and draining."""

from __future__ import annotations

import asyncio
import ipaddress
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tokenmill_service import __version__
from tokenmill_service.banner import show_ready_banner
from tokenmill_service.config import Settings, load_settings
from tokenmill_service.log_setup import configure_logging
from tokenmill_service.metrics import Metrics
from tokenmill_service.proto import pb
from tokenmill_service.reflection import enable_reflection
from tokenmill_service.router import Router, WorkerStartError
from tokenmill_service.server import GenerationServicer, adapter_state, add_generation_servicer, engine_totals

log = structlog.get_logger("tokenmill.main")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name


async def serve(settings: Settings) -> int:
    from tokenmill_service.models.paths import ModelNotFoundError, resolve_model_path
    from tokenmill_service.tokenizer import load_tokenizer

    if settings.node_rank > 0:
        # A node above 0 of a replica spanning servers runs its ranks only.
        from tokenmill_service.follower_node import serve_follower_node

        return await serve_follower_node(settings)

    try:
        model_path = resolve_model_path(settings.model or None)
    except (ModelNotFoundError, FileNotFoundError, ValueError) as exc:
        log.error("model_unavailable", error=str(exc))
        return 1
    if settings.tensor_parallel > 1 or settings.expert_parallel:
        try:
            check_tensor_parallel(settings, model_path)
        except ValueError as exc:
            # A usage error, known before any worker starts: the same exit code as a bad flag.
            log.error("tensor_parallel_refused", error=str(exc))
            sys.stderr.write(f"tokenmill-server: error: {exc}\n")
            return 2

    # The first SIGTERM or SIGINT drains; a second one, during the drain, stops at once.
    stop = asyncio.Event()
    stop_now = asyncio.Event()
    received: list[signal.Signals] = []

    def on_signal(sig: signal.Signals) -> None:
        received.append(sig)
        (stop_now if stop.is_set() else stop).set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)

    # The workers start (seconds: their imports, the weights) while this process reads the tokenizer (about a
    # second for a 128k vocabulary); a failure here kills them, so what is refused is refused as before.
    metrics = Metrics()
    router = Router(settings, metrics)
    starting = asyncio.ensure_future(router.start())

    def abandon_start() -> None:
        starting.cancel()
        router.kill()

    try:
        tokenizer = await asyncio.to_thread(load_tokenizer, model_path)
        template = settings.chat_template_source()
        if template is not None:
            # Chats are rendered here, in the server process; the workers never render one.
            tokenizer.chat_template = template
    except (ModelNotFoundError, FileNotFoundError, ValueError) as exc:
        abandon_start()
        log.error("model_unavailable", error=str(exc))
        return 1
    if tokenizer.harmony:
        from tokenmill_service import harmony

        try:  # loaded now (a second or two), so that the first chat request does not wait for it
            harmony.encoding()
        except harmony.HarmonyUnavailable as exc:
            log.warning("harmony_chats_refused", reason=str(exc))

    metrics.bind_state(lambda: engine_totals(router))
    metrics.bind_adapters(lambda: adapter_state(router, settings.max_loras))
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
        abandon_start()
        log.error("cannot_read_tls_files", error=str(exc))
        return 1
    except RuntimeError as exc:
        abandon_start()
        log.error("cannot_listen", address=address, error=str(exc))
        return 1
    http_server = None
    if settings.http_port:
        from tokenmill_service.http_api import HttpApi
        from tokenmill_service.http_server import HttpServer

        try:
            http_server = HttpServer(HttpApi(servicer.service), settings.host, settings.http_port)
        except OSError as exc:
            abandon_start()
            log.error("cannot_listen", address=f"{settings.host}:{settings.http_port}", error=str(exc))
            return 1

    if not settings.auth_tokens() and not loopback(settings.host):
        log.warning(
            "listening_without_auth",
            host=settings.host,
            message="anyone who reaches this address can generate: set --auth-token or --auth-token-file, "
            "or listen on 127.0.0.1 behind a proxy that authenticates",
        )

    async def set_health(status: int) -> None:
        for name in ("", SERVICE_NAME):
            await health_servicer.set(name, status)

    # Probes that cannot speak TLS (kubelet's) get the health service alone, in plaintext, on its own port.
    health_server: grpc.aio.Server | None = None
    if settings.health_port:
        health_server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, health_server)
        health_server.add_insecure_port(f"{settings.host}:{settings.health_port}")
        await health_server.start()
    await set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.start()
    if http_server is not None:
        http_server.start()
    if settings.metrics_port:
        guard = None if settings.metrics_without_auth else servicer.service.authorized
        metrics.serve(settings.metrics_port, settings.host, guard)
    log.info(
        "server_listening",
        address=address,
        tls="mutual" if settings.tls_client_ca else bool(settings.tls_cert),
        model=str(model_path),
        workers=router.num_workers,
        device=settings.device,
        metrics_port=settings.metrics_port or None,
        http_port=settings.http_port or None,
    )

    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    exit_code = 0
    if starting.done() and starting.exception() is None:
        await set_health(health_pb2.HealthCheckResponse.SERVING)
        info = next(w.info for w in router.workers if w.info is not None)
        metrics.set_build_info(__version__, info.model_name, settings.backend, info.dtype, info.quantization)
        metrics.bind_endpoint_picker(
            lambda: engine_totals(router),
            servicer.service.model_name(),
            info.kv_block_size,
            sum(w.info.kv_blocks_total for w in router.workers if w.info is not None),
        )
        watcher = asyncio.ensure_future(follow_workers(router, set_health))
        log.info("server_ready", address=address, http_port=settings.http_port or None)
        # The commands to try, plain and copy-pasteable (not inside a log line): on a terminal, or as --banner says.
        show_ready_banner(settings, info.model_name)
        await stopping
        watcher.cancel()
    elif starting.done():
        failure = starting.exception()
        log.error(
            "workers_failed_to_start",
            error=str(failure) if isinstance(failure, WorkerStartError) else repr(failure),
        )
        if isinstance(failure, WorkerStartError) and failure.usage:
            # The model or the flags cannot be served as asked: the same exit code as a bad flag.
            sys.stderr.write(f"tokenmill-server: error: {failure}\n")
            exit_code = 2
        else:
            exit_code = 1
    else:
        starting.cancel()

    # Drain: refuse new calls, let in-flight ones finish within drain_seconds, then exit.
    log.info(
        "draining",
        signal=received[0].name if received else None,
        drain_seconds=settings.drain_seconds,
        in_flight=router.inflight_count(),
        hint="send SIGINT (Ctrl-C) or SIGTERM again to stop at once",
    )

    async def shut_down() -> None:
        router.draining = True
        await set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        await router.drain(settings.drain_seconds)
        await server.stop(grace=1.0)
        if health_server is not None:
            await health_server.stop(grace=None)
        if http_server is not None:
            await http_server.stop()
        await router.stop()

    shutting_down = asyncio.ensure_future(shut_down())
    interrupted = asyncio.ensure_future(stop_now.wait())
    await asyncio.wait({shutting_down, interrupted}, return_when=asyncio.FIRST_COMPLETED)
    if not shutting_down.done():
        shutting_down.cancel()
        # A second signal: no more waiting for calls or workers; kill the workers and go.
        sig = received[-1]
        log.warning("stopping_now", signal=sig.name, in_flight=router.inflight_count())
        router.kill()
        await server.stop(grace=None)
        if health_server is not None:
            await health_server.stop(grace=None)
        if http_server is not None:
            await http_server.stop()
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
    from tokenmill_service.distributed.degree import check_degree
    from tokenmill_service.models.dims import read_dims

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
    return asyncio.run(serve(settings))


if __name__ == "__main__":
    sys.exit(main())
