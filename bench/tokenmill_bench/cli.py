"""`tokenmill-bench`: single-stream latency, throughput under concurrency and memory bandwidth, over gRPC.

tokenmill-bench [--server ADDRESS] [--json PATH] [--plot PNG] [options]   # measure
tokenmill-bench plot RESULTS.json OUT.png                                 # redraw the plot
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import sys
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import structlog

from tokenmill_bench.load import LevelResult, run_level
from tokenmill_bench.machine import copy_bandwidth, loadavg, machine_info
from tokenmill_bench.model import count_parameters, default_model_path, weight_bytes
from tokenmill_bench.report import format_tables, headline

log = structlog.get_logger("tokenmill.bench")

PEERS = ("llama-cpp",)


def _concurrency_list(text: str) -> list[int]:
    try:
        values = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}") from None
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError("concurrency levels must be positive integers")
    return values


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenmill-bench",
        description=(
            "Benchmark a tokenmill server through gRPC with fixed-length requests (token-id prompts, ignore_eos). "
            "Starts its own server unless --server is given. 'tokenmill-bench plot RESULTS.json OUT.png' redraws "
            "the plot from a results file; 'tokenmill-bench table RESULTS.json' reprints its tables."
        ),
    )
    target = parser.add_argument_group("server")
    target.add_argument("--server", metavar="ADDRESS", help="measure a running server instead of starting one")
    target.add_argument("--model", help="model for the started server, and for counting weight bytes")
    target.add_argument(
        "--server-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for the started server, repeatable (e.g. --server-arg=--max-batch-size=32)",
    )
    load = parser.add_argument_group("load")
    load.add_argument("--prompt-tokens", type=_positive, default=32, help="prompt length in token ids (default 32)")
    load.add_argument("--output-tokens", type=_positive, default=128, help="tokens generated per request (default 128)")
    load.add_argument(
        "--concurrency",
        type=_concurrency_list,
        default=[1, 4, 16, 64],
        help="comma-separated concurrency levels (default 1,4,16,64)",
    )
    load.add_argument(
        "--rounds", type=_positive, default=2, help="requests per level = rounds x concurrency (default 2)"
    )
    load.add_argument(
        "--min-requests", type=_positive, default=3, help="at least this many requests per level (default 3)"
    )
    load.add_argument("--warmup", type=int, default=1, help="short unmeasured requests first (default 1)")
    load.add_argument(
        "--shared-prompt",
        action="store_true",
        help="send the identical prompt every time (by default each request's first token differs, so the "
        "server's prefix cache cannot skip prefill)",
    )
    load.add_argument(
        "--ramp-s",
        type=float,
        default=0.0,
        help="start each level's streams spread evenly over this many seconds (default 0: all at once, a burst; "
        "equal-length requests then keep arriving in bursts, one per round)",
    )
    load.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request (default 600)")
    out = parser.add_argument_group("results")
    out.add_argument("--weight-bytes", type=int, help="model weight bytes (default: counted from the model file)")
    out.add_argument(
        "--copy-buffer-mib", type=_positive, default=256, help="buffer for the memory copy measurement (default 256)"
    )
    out.add_argument("--peer", choices=PEERS, help="also run llama.cpp (llama-cpp-python) on the same GGUF")
    out.add_argument("--json", type=Path, metavar="PATH", help="write the results as JSON here")
    out.add_argument("--plot", type=Path, metavar="PNG", help="also draw throughput/latency vs concurrency here")
    out.add_argument("--server-log", type=Path, metavar="PATH", help="keep the started server's log here")
    out.add_argument("--quiet", action="store_true", help="no progress log on stderr")
    return parser


def configure_logging(quiet: bool) -> None:
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="%H:%M:%S"),
            structlog.dev.ConsoleRenderer(colors=False),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(40 if quiet else 20),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )


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


async def _measure(
    address: str, args: argparse.Namespace, server_pids: Callable[[], list[int]] | None
) -> tuple[dict[str, Any], LevelResult, list[LevelResult]]:
    from tokenmill_client import AsyncClient

    # No retries: a refused request is a failure to count, not one to hide.
    async with AsyncClient(address, max_retries=0) as client:
        info = await client.model_info(timeout=30.0)
        common: dict[str, Any] = {
            "prompt_tokens": args.prompt_tokens,
            "vocab_size": info.vocab_size,
            "shared_prompt": args.shared_prompt,
            "timeout": args.request_timeout,
        }
        if args.warmup > 0:
            log.info("warmup", requests=args.warmup)
            warm = await run_level(
                client,
                concurrency=1,
                num_requests=args.warmup,
                output_tokens=min(8, args.output_tokens),
                label="warmup",
                first_index=900_000,
                sample_period=0,
                **common,
            )
            if warm.failed:
                log.warning("warmup_failed", errors=warm.errors())

        levels: list[LevelResult] = []
        single: LevelResult | None = None
        first_index = 0
        wanted = sorted(set(args.concurrency) | {1})
        for concurrency in wanted:
            n = max(concurrency * args.rounds, args.min_requests)
            log.info("level_start", concurrency=concurrency, requests=n, output_tokens=args.output_tokens)
            level = await run_level(
                client,
                concurrency=concurrency,
                num_requests=n,
                output_tokens=args.output_tokens,
                label=f"c{concurrency}",
                first_index=first_index,
                ramp_s=args.ramp_s if concurrency > 1 else 0.0,
                server_pids=server_pids,
                **common,
            )
            first_index += n
            log.info(
                "level_done",
                concurrency=concurrency,
                tok_s=round(level.throughput_tok_s, 1),
                wall_s=round(level.wall_s, 1),
                failed=level.failed,
                other_load_cores=None if (o := level.other_load_cores) is None else round(o, 2),
            )
            if concurrency == 1:
                single = level
            if concurrency in args.concurrency:
                levels.append(level)
        assert single is not None
        info_after = await client.model_info(timeout=30.0)
    model_info = {
        "name": info.name,
        "context_length": info.context_length,
        "vocab_size": info.vocab_size,
        "backend": info.backend,
        "device": info.device,
        "dtype": info.dtype,
        "num_workers": info.num_workers,
        "max_batch_size": info.limits.max_batch_size,
        "max_queue": info.limits.max_queue,
        "kv_blocks_total": info.engine.kv_blocks_total,
        "kv_block_size": info.engine.kv_block_size,
        "worker_restarts_after": sum(w.restarts for w in info_after.workers),
    }
    return model_info, single, levels


def run(args: argparse.Namespace) -> int:
    started = time.monotonic()
    timestamp = datetime.now(timezone.utc).isoformat(timespec="seconds")
    # The machine may be shared: a high load average around the run explains noisy numbers.
    load_at_start = loadavg()
    # Measured before the server loads, so the copy has the memory system to itself.
    log.info("copy_bandwidth", buffer_mib=args.copy_buffer_mib)
    copy = copy_bandwidth(args.copy_buffer_mib * 2**20)
    log.info("copy_bandwidth_done", gbs=round(copy["gbs"], 2), method=copy["method"])

    model_path = _resolve_model_path(args)
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    # Counting reads the checkpoint's metadata (seconds for a GGUF): overlap it with the server's start.
    counting = pool.submit(_count_weights, model_path) if args.weight_bytes is None else None

    server = None
    server_args: list[str] = []
    address = args.server
    if address is None:
        from tokenmill_bench.server import ManagedServer

        if args.model:
            server_args += ["--model", args.model]
        server_args += args.server_arg
        server = ManagedServer(server_args)
        log.info("server_starting", args=" ".join(server_args) or "(defaults)", log=server.log_path)
        try:
            server.start()
        except (RuntimeError, FileNotFoundError) as exc:
            sys.stderr.write(f"tokenmill-bench: error: could not start the server: {exc}\n")
            server.close()
            pool.shutdown()
            return 2
        address = server.address
        log.info("server_ready", address=address, startup_s=round(server.startup_s or 0, 1))

    from tokenmill_client import TokenmillError

    parameters: int | None = None
    weight_note: str | None = "given with --weight-bytes"
    if counting is not None:
        # Before measuring: the count holds the GIL for seconds, which would delay the streams' timestamps.
        parameters, weight_note = counting.result()
    pool.shutdown()

    pids = server.pids if server is not None else None
    server_exit: int | None = None
    try:
        model_info, single, levels = asyncio.run(_measure(address, args, pids))
    except TokenmillError as exc:
        sys.stderr.write(f"tokenmill-bench: error: {address}: {exc}\n")
        return 2
    finally:
        if server is not None:
            server_exit = server.stop()
            if args.server_log is not None:
                args.server_log.write_text(server.tail(chars=-1))
            server.close()
    machine = machine_info(model_info["device"])
    machine["loadavg_at_start"], machine["loadavg_at_end"] = load_at_start, loadavg()

    total_weight_bytes: int | None = args.weight_bytes
    if parameters and model_path is not None:
        # The server names a model after its file (GGUF) or directory: a different name means we counted
        # the wrong checkpoint (e.g. --server without --model), and a wrong bandwidth is worse than none.
        counted_name = model_path.resolve().name if model_path.is_dir() else model_path.name.removesuffix(".gguf")
        if model_info["name"] and counted_name != model_info["name"]:
            weight_note = f"not counted: the server serves {model_info['name']!r}, not {counted_name!r}; pass --model"
            parameters = None
        else:
            try:
                total_weight_bytes = weight_bytes(parameters, model_info["dtype"])
            except ValueError as exc:
                weight_note = str(exc)

    peer: dict[str, Any] | None = None
    if args.peer == "llama-cpp":
        peer = _run_peer(args, model_path, model_info["vocab_size"])

    single_summary = single.summary()
    level_summaries = [level.summary() for level in levels]
    result: dict[str, Any] = {
        "tool": "tokenmill-bench",
        "timestamp": timestamp,
        **headline(single_summary, level_summaries, total_weight_bytes),
        "copy_bandwidth_gbs": copy["gbs"],
        "failed_requests": single.failed + sum(level.failed for level in levels if level is not single),
        "bandwidth_convention": "model weight bytes x single-stream decode tok/s (every weight read once per token)",
        "copy_bandwidth": copy,
        "machine": machine,
        "model": {
            **model_info,
            "path": str(model_path) if model_path else None,
            "parameters": parameters,
            "bytes_per_parameter": (total_weight_bytes // parameters) if parameters and total_weight_bytes else None,
            "weight_bytes": total_weight_bytes,
            "weight_bytes_note": weight_note,
        },
        "server": {
            "address": address,
            "managed": server is not None,
            "args": server_args if server is not None else None,
            "startup_s": server.startup_s if server is not None else None,
            "exit_code": server_exit,
            "rss_max_bytes": max((lv["server_rss_max_bytes"] or 0 for lv in level_summaries), default=0) or None,
        },
        "settings": {
            "prompt_tokens": args.prompt_tokens,
            "output_tokens": args.output_tokens,
            "concurrency": args.concurrency,
            "rounds": args.rounds,
            "min_requests": args.min_requests,
            "requests_per_level": {str(c): max(c * args.rounds, args.min_requests) for c in args.concurrency},
            "warmup": args.warmup,
            "shared_prompt": args.shared_prompt,
            "ramp_s": args.ramp_s,
            "request_timeout_s": args.request_timeout,
            "sampling": "greedy (temperature 0), ignore_eos",
            "single_stream_from": "the concurrency-1 level",
        },
        "single_stream": single_summary,
        "levels": level_summaries,
        "peer": peer,
        "duration_s": time.monotonic() - started,
    }
    result["warnings"] = run_warnings(result)
    sys.stdout.write(format_tables(result) + "\n")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        log.info("json_written", path=str(args.json))
    if args.plot is not None:
        from tokenmill_bench.plot import plot_result

        plot_result(result, args.plot)
        log.info("plot_written", path=str(args.plot))
    log.info("done", seconds=round(result["duration_s"], 1), failed_requests=result["failed_requests"])
    return 0 if result["failed_requests"] == 0 else 1


# Other processes keeping this much of a core busy on average make a level's numbers suspect.
OTHER_LOAD_WARNING_CORES = 0.25


def run_warnings(result: dict[str, Any]) -> list[str]:
    """Things that make the numbers less trustworthy, said once in the JSON and under the table."""
    warnings = []
    for level in [result["single_stream"], *result["levels"]]:
        other = level.get("other_load_cores")
        if other is not None and other > OTHER_LOAD_WARNING_CORES:
            warnings.append(
                f"concurrency {level['concurrency']}: other processes kept {other:.2f} cores busy on average "
                f"(of {result['machine']['cores']}); its numbers are pessimistic"
            )
    restarts = result["model"].get("worker_restarts_after")
    if restarts:
        warnings.append(f"the server's workers restarted {restarts} times during the run")
    exit_code = result["server"].get("exit_code")
    if exit_code not in (None, 0):
        warnings.append(f"the started server exited with code {exit_code}")
    return list(dict.fromkeys(warnings))


def _run_peer(args: argparse.Namespace, model_path: Path | None, vocab_size: int) -> dict[str, Any]:
    from tokenmill_bench.peer import llama_cpp_available, run_llama_cpp

    if not llama_cpp_available():
        log.warning("peer_skipped", reason="llama_cpp is not importable (pip install llama-cpp-python)")
        return {"name": "llama-cpp-python", "skipped": "llama_cpp is not importable; pip install llama-cpp-python"}
    if model_path is None or model_path.is_dir():
        return {"name": "llama-cpp-python", "skipped": "llama.cpp needs a GGUF model file"}
    log.info("peer_start", peer="llama-cpp", model=str(model_path))
    try:
        return run_llama_cpp(
            model_path,
            prompt_tokens=args.prompt_tokens,
            output_tokens=args.output_tokens,
            requests=args.min_requests,
            vocab_size=vocab_size,
        )
    except (OSError, ValueError, RuntimeError) as exc:  # a broken optional peer must not lose the main results
        log.warning("peer_failed", error=repr(exc))
        return {"name": "llama-cpp-python", "skipped": f"failed: {exc!r}"}


def plot_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="tokenmill-bench plot", description="Draw the plot from a results JSON.")
    parser.add_argument("results", type=Path, help="JSON written by tokenmill-bench --json")
    parser.add_argument("png", type=Path, help="PNG to write")
    args = parser.parse_args(argv)
    from tokenmill_bench.plot import plot_results

    try:
        plot_results(args.results, args.png)
    except (OSError, ValueError, KeyError) as exc:
        sys.stderr.write(f"tokenmill-bench plot: error: {exc}\n")
        return 2
    sys.stdout.write(f"{args.png}\n")
    return 0


def table_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="tokenmill-bench table", description="Print the tables of a results JSON.")
    parser.add_argument("results", type=Path, help="JSON written by tokenmill-bench --json")
    args = parser.parse_args(argv)
    try:
        sys.stdout.write(format_tables(json.loads(args.results.read_text())) + "\n")
    except (OSError, ValueError, KeyError) as exc:
        sys.stderr.write(f"tokenmill-bench table: error: {exc}\n")
        return 2
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments[:1] == ["plot"]:
        return plot_main(arguments[1:])
    if arguments[:1] == ["table"]:
        return table_main(arguments[1:])
    if arguments[:1] == ["run"]:
        arguments = arguments[1:]
    args = build_parser().parse_args(arguments)
    configure_logging(args.quiet)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
