"""The connection: its flags (on the main parser and on every command) and the Client they make."""

from __future__ import annotations

import argparse
import os
import threading
from typing import Any

from .._transport import LOAD_BALANCING_POLICIES, default_target
from ..client import Client
from .report import UsageError, err

ENV_TOKEN = "TOKENMILL_TOKEN"
ENV_LOAD_BALANCING = "TOKENMILL_LOAD_BALANCING"

# Enough retries to wait out a normal start of the server (the embedded model: about 10 s warm, 30 s cold):
# 0.2, 0.4, 0.8, 1.6 s, then 2 s apart (each +-20 %), about 35 s in all.
DEFAULT_MAX_RETRIES = 20
# gRPC's own reconnection backoff grows to 120 s; capped so a server that starts listening is reached soon.
_CHANNEL_OPTIONS = (("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 2000))
# With round_robin the CLI waits this long for every address before its first call (--wait-for-addresses).
ROUND_ROBIN_WAIT_SECONDS = 5.0


class _WaitingNotice:
    """Says once, on stderr, that the CLI is waiting for the server (not once per retry)."""

    def __init__(self, target: str) -> None:
        self.target = target
        self._lock = threading.Lock()
        self._said = False

    def __call__(self, retry: int, delay: float) -> None:
        with self._lock:
            if self._said:
                return
            self._said = True
        err(f"waiting for the server at {self.target} (unavailable; retrying up to --max-retries times)...\n")


def client_from_args(args: argparse.Namespace) -> Client:
    wait = args.wait_for_addresses
    if wait is None:
        wait = ROUND_ROBIN_WAIT_SECONDS if args.load_balancing == "round_robin" else 0.0
    if wait < 0:
        raise UsageError("--wait-for-addresses must be at least 0")
    try:
        client = Client(
            args.server,
            tls=args.tls,
            root_certificates=args.root_certificates,
            token=args.token,
            timeout=args.timeout,
            max_retries=args.max_retries,
            options=_CHANNEL_OPTIONS,
            on_retry=_WaitingNotice(args.server or default_target()),
            load_balancing=args.load_balancing,
        )
    except OSError as exc:
        raise UsageError(f"cannot read the root certificates {args.root_certificates}: {exc.strerror}") from exc
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    if wait > 0:
        connections = client.wait_for_addresses(wait)
        if connections.observed and 0 < connections.ready < connections.total:
            err(
                f"connected to {connections.ready} of the {connections.total} addresses of {client.target} "
                f"after {wait:g} s; calls go to those\n"
            )
    return client


def connection_options(parser: argparse.ArgumentParser, *, top_level: bool) -> None:
    """The same options on the main parser (with defaults) and each command (only overriding when given)."""

    def default(value: Any) -> Any:
        return value if top_level else argparse.SUPPRESS

    group = parser.add_argument_group("connection")
    group.add_argument(
        "--server",
        metavar="ADDRESS",
        default=default(default_target()),
        help="server address host:port, or any gRPC target: dns:///HOST:PORT (every address the name "
        "resolves to, with --load-balancing round_robin), ipv4:IP:PORT,IP:PORT "
        "(default: $TOKENMILL_SERVER, else localhost:50051)",
    )
    group.add_argument(
        "--load-balancing",
        choices=LOAD_BALANCING_POLICIES,
        default=default(os.environ.get(ENV_LOAD_BALANCING) or None),
        help="round_robin: spread calls over every address the server's name resolves to (a headless "
        "Service's pods); pick_first: one connection, gRPC's default "
        f"(default: ${ENV_LOAD_BALANCING}, else pick_first)",
    )
    group.add_argument(
        "--wait-for-addresses",
        type=float,
        metavar="SECONDS",
        default=default(None),
        help="before the first call, wait at most SECONDS until a connection to every address is ready "
        "(round_robin sends calls only to the addresses connected so far) "
        f"(default: {ROUND_ROBIN_WAIT_SECONDS:g} with round_robin, else 0)",
    )
    group.add_argument("--tls", action="store_true", default=default(False), help="connect with TLS")
    group.add_argument(
        "--root-certificates",
        "--tls-ca",
        metavar="PEM_FILE",
        default=default(None),
        help="trusted CA certificates (implies --tls)",
    )
    group.add_argument(
        "--token",
        default=default(os.environ.get(ENV_TOKEN) or None),
        help=f"bearer token sent as 'authorization: Bearer TOKEN' (default: ${ENV_TOKEN})",
    )
    group.add_argument("--timeout", type=float, metavar="SECONDS", default=default(None), help="deadline of each call")
    group.add_argument(
        "--max-retries",
        type=int,
        metavar="N",
        default=default(DEFAULT_MAX_RETRIES),
        help="retries while the server is unavailable (starting, restarting), before any output; "
        f"about 35 s in all (default: {DEFAULT_MAX_RETRIES})",
    )
