"""A measuring run from end to end: the machine's memory bandwidth, the server (started here or given), the
measurement, and the results printed as tables and written as JSON and a plot."""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from tokenmill_bench.machine import buffer_bytes, copy_bandwidth, core_scaling, loadavg, machine_info, read_bandwidth
from tokenmill_bench.measure import Measured, measure
from tokenmill_bench.model import count_parameters, default_model_path
from tokenmill_bench.report import format_tables
from tokenmill_bench.results import ServerFacts, build_result, comparison, peer_section, run_warnings, weights

if TYPE_CHECKING:
    from tokenmill_bench.server import ManagedServer

log = structlog.get_logger("tokenmill.bench")


def _resolve_model_path(args: argparse.Namespace) -> Path | None:
    if args.model:
        return Path(args.model).expanduser()
    return default_model_path()


def _count_weights(model_path: Path | None) -> tuple[int | None, str | None]:
    """(parameters, why not) — never raises: bandwidth is reported as unknown rather than failing the run."""
    if model_path is None:
        return None, "model file not found (pass --model or --weight-bytes)"
    try:
        return count_parameters(model_path), None
    except (ImportError, OSError, ValueError) as exc:
        return None, f"cannot count parameters of {model_path}: {exc}"


def _memory_bandwidth(buffer_mib: int | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The machine's copy and read rates (measured before the server loads, so they have the memory to
    themselves), on buffers of machine.buffer_bytes(buffer_mib)."""
    size = buffer_bytes(buffer_mib)
    log.info("copy_bandwidth", buffer_mib=size // 2**20)
    copy = copy_bandwidth(size)
    log.info("copy_bandwidth_done", gbs=round(copy["gbs"], 2), method=copy["method"])
    read = read_bandwidth(size)
    log.info("read_bandwidth_done", gbs=round(read["gbs"], 2), method=read["method"])
    return copy, read


def _start_server(args: argparse.Namespace, server_args: list[str]) -> ManagedServer | None:
    """A server started with ``server_args``, or None when it did not start (said on stderr)."""
    from tokenmill_bench.server import ManagedServer

    server = ManagedServer(server_args, args.server_log)
    log.info("server_starting", args=" ".join(server_args) or "(defaults)", log=server.log_path)
    try:
        server.start()
    except (RuntimeError, FileNotFoundError) as exc:
        sys.stderr.write(f"tokenmill-bench: error: could not start the server (log: {server.log_path}): {exc}\n")
        server.close()
        return None
    log.info("server_ready", address=server.address, startup_s=round(server.startup_s or 0, 1))
    return server


def _measure_then_stop(
    address: str, args: argparse.Namespace, server: ManagedServer | None
) -> tuple[Measured | None, int | None]:
    """The measurement (None when a side failed: said on stderr) and the started server's exit code."""
    from tokenmill_client import TokenmillError

    pids = server.pids if server is not None else None
    peer_errors: tuple[type[BaseException], ...] = ()  # catches nothing
    if args.peer is not None:
        from tokenmill_bench.llama_server import PEER_ERRORS as peer_errors
    server_exit: int | None = None
    measured: Measured | None = None
    try:
        measured = asyncio.run(measure(address, args, pids))
    except TokenmillError as exc:
        sys.stderr.write(f"tokenmill-bench: error: {address}: {exc}\n")
    except peer_errors as exc:  # the peer unreachable, or not answering /props
        sys.stderr.write(f"tokenmill-bench: error: peer {args.peer[1]}: {exc!r}\n")
    finally:
        if server is not None:
            server_exit = server.stop()
            server.close()
    return measured, server_exit


def run(args: argparse.Namespace) -> int:
    started = time.monotonic()
    timestamp = datetime.now(timezone.utc).isoformat(timespec="seconds")
    # The machine may be shared: a high load average around the run explains noisy numbers.
    load_at_start = loadavg()
    bandwidth = _memory_bandwidth(args.copy_buffer_mib)
    scaling_at_start = core_scaling()

    model_path = _resolve_model_path(args)
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    # Counting reads the checkpoint's metadata (seconds for a GGUF): overlap it with the server's start.
    counting = pool.submit(_count_weights, model_path) if args.weight_bytes is None else None

    server = None
    server_args: list[str] = []
    address = args.server
    if address is None:
        server_args = [*(["--model", args.model] if args.model else []), *args.server_arg]
        server = _start_server(args, server_args)
        if server is None:
            pool.shutdown()
            return 2
        address = server.address

    parameters: int | None = None
    weight_note: str | None = "given with --weight-bytes"
    if counting is not None:
        # Before measuring: the count holds the GIL for seconds, which would delay the streams' timestamps.
        parameters, weight_note = counting.result()
    pool.shutdown()

    measured, server_exit = _measure_then_stop(address, args, server)
    if measured is None:
        return 2
    machine = machine_info(measured.model_info["device"])
    machine["loadavg_at_start"], machine["loadavg_at_end"] = load_at_start, loadavg()
    machine["core_scaling"] = {"start": scaling_at_start, "end": core_scaling()}
    facts = ServerFacts(
        address=address,
        managed=server is not None,
        args=server_args if server is not None else None,
        startup_s=server.startup_s if server is not None else None,
        exit_code=server_exit,
    )
    found = weights(args.weight_bytes, measured.model_info, model_path, parameters, weight_note)
    result: dict[str, Any] = {
        "tool": "tokenmill-bench",
        "timestamp": timestamp,
        **build_result(args, measured, found, facts, bandwidth, machine),
        "duration_s": time.monotonic() - started,
    }
    if args.peer is not None:
        result["peer"] = peer_section(args.peer, measured, model_path)
        result["comparison"] = comparison(result)
        result["duration_s"] = time.monotonic() - started
    result["warnings"] = run_warnings(result)
    _write_results(args, result)
    log.info(
        "done",
        seconds=round(result["duration_s"], 1),
        failed_requests=result["failed_requests"],
        server_log=server.log_path if server is not None else None,
    )
    return 0 if result["failed_requests"] == 0 else 1


def _write_results(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """The tables on stdout; the JSON and the plot where --json and --plot say."""
    sys.stdout.write(format_tables(result) + "\n")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        log.info("json_written", path=str(args.json))
    if args.plot is not None:
        from tokenmill_bench.plot import plot_result

        plot_result(result, args.plot)
        log.info("plot_written", path=str(args.plot))
