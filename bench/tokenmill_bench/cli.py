"""`tokenmill-bench`: single-stream latency, throughput under concurrency and memory bandwidth, over gRPC.

tokenmill-bench [--server ADDRESS] [--json PATH] [--plot PNG] [options]   # measure
tokenmill-bench plot RESULTS.json OUT.png                                 # redraw the plot
tokenmill-bench lora [options]                                            # adapters against the base
tokenmill-bench results [--check]                                         # bench/RESULTS.md from bench/results/
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import random
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from tokenmill_bench.load import (
    LevelResult,
    RequestRecord,
    Target,
    TokenmillTarget,
    random_prompt_ids,
    run_in_turns,
    run_level,
)
from tokenmill_bench.machine import copy_bandwidth, loadavg, local_server_pids, machine_info, read_bandwidth
from tokenmill_bench.model import count_parameters, default_model_path, gguf_tensor_bytes, weight_bytes
from tokenmill_bench.report import format_tables, headline

if TYPE_CHECKING:
    from tokenmill_bench.llama_server import LlamaServer

log = structlog.get_logger("tokenmill.bench")

PEERS = ("llama-server",)
DEFAULT_CONCURRENCY = (1, 4, 16, 64)
# Each level runs twice with a peer: fewer levels keep the run about as long.
PEER_CONCURRENCY = (1, 16, 64)
DEFAULT_LONG_PROMPTS = (1000, 4000)
WARMUP_FIRST_INDEX = 19_000


def _concurrency_list(text: str) -> list[int]:
    try:
        values = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}") from None
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError("concurrency levels must be positive integers")
    return values


def _length_list(text: str) -> list[int]:
    """Prompt lengths for the long-prompt scenario; '' or '0' runs none."""
    if text.strip() in ("", "0"):
        return []
    return _concurrency_list(text)


def _peer_spec(text: str) -> tuple[str, str]:
    name, sep, url = text.partition("=")
    if not sep or name not in PEERS or not url.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(
            f"expected NAME=URL with NAME one of {', '.join(PEERS)}, e.g. llama-server=http://127.0.0.1:8080; "
            f"got {text!r}"
        )
    return name, url


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
        default=None,
        help="comma-separated concurrency levels (default 1,4,16,64; with --peer 1,16,64)",
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
    constrained = load.add_mutually_exclusive_group()
    constrained.add_argument(
        "--json-schema",
        type=Path,
        metavar="FILE",
        help="constrain every tokenmill request to the JSON Schema in FILE (a request whose schema is complete "
        "ends early with eos; its tokens still count), to compare with an unconstrained run",
    )
    constrained.add_argument("--regex", metavar="REGEX", help="constrain every tokenmill request to REGEX")
    out = parser.add_argument_group("results")
    out.add_argument("--weight-bytes", type=int, help="model weight bytes (default: counted from the model file)")
    out.add_argument(
        "--copy-buffer-mib", type=_positive, default=256, help="buffer for the memory copy measurement (default 256)"
    )
    out.add_argument(
        "--peer",
        type=_peer_spec,
        metavar="NAME=URL",
        help="also drive a running peer server with the same requests, alternately with tokenmill (one stream: "
        "a request each in turn; more: a level each in turn), and print both side by side: "
        "llama-server=http://127.0.0.1:PORT (llama.cpp's server, "
        "see bench/README.md)",
    )
    out.add_argument(
        "--long-prompts",
        type=_length_list,
        default=None,
        metavar="LENGTHS",
        help="time to first token of one request per length of random token ids with max_new_tokens 1, on both "
        f"sides (default with --peer: {','.join(map(str, DEFAULT_LONG_PROMPTS))}; otherwise none; 0 for none)",
    )
    parser.add_argument(
        "--long-prompt-seed",
        type=int,
        default=None,
        help="seed of the long prompts' token ids (default: a fresh one each run, so that no cache, such as a "
        "llama-server slot kept from an earlier run, has seen them; the JSON records it)",
    )
    out.add_argument("--json", type=Path, metavar="PATH", help="write the results as JSON here")
    out.add_argument("--plot", type=Path, metavar="PNG", help="also draw throughput/latency vs concurrency here")
    out.add_argument(
        "--server-log",
        type=Path,
        metavar="PATH",
        help="write the started server's log here (default: a temporary file)",
    )
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


@dataclass(slots=True)
class SideRun:
    """What one side (tokenmill or the peer) measured: its first request, its levels, its long prompts."""

    first_request: RequestRecord | None = None
    single: LevelResult | None = None
    # The machine's read rate measured right after the single stream: on a shared host the rate moves by
    # minutes, and the share of it a stream achieves means something only against the rate of its moment.
    single_read_gbs: float | None = None
    levels: list[LevelResult] = field(default_factory=list)
    long_prompts: list[dict[str, Any]] = field(default_factory=list)


@dataclass(slots=True)
class Measured:
    model_info: dict[str, Any]
    sides: dict[str, SideRun]
    peer_props: dict[str, Any] | None = None


@asynccontextmanager
async def _open_peer(spec: tuple[str, str] | None) -> AsyncIterator[LlamaServer | None]:
    if spec is None:
        yield None
        return
    from tokenmill_bench.llama_server import LlamaServer

    async with LlamaServer(spec[1]) as peer:
        yield peer


def _long_prompt_row(length: int, record: RequestRecord) -> dict[str, Any]:
    ttft = record.ttft_s
    return {
        "prompt_tokens": length,
        "ttft_ms": ttft * 1000.0 if ttft is not None and record.error is None else None,
        "server_ttft_ms": record.server_ttft_ms,
        "error": record.error,
    }


async def _measure(address: str, args: argparse.Namespace, server_pids: Callable[[], list[int]] | None) -> Measured:
    """Warm-up, then each concurrency level and each long prompt, tokenmill first and then the peer (when
    given) with the same requests, so both see the same machine load as nearly as one run allows."""
    from tokenmill_bench.load import sample_engine
    from tokenmill_client import AsyncClient

    # No retries: a refused request is a failure to count, not one to hide.
    async with AsyncClient(address, max_retries=0) as client, _open_peer(args.peer) as peer:
        info = await client.model_info(timeout=30.0)
        if server_pids is None:
            # A server this run did not start: on this machine, its processes are still known, so other
            # processes' load on the cores is measured (and warned about) as for a started one.
            ranks = [r.pid for w in info.workers for r in w.ranks if r.pid]
            local = local_server_pids(address, ranks)
            if local is None:
                log.info("other_load_unmeasured", reason="the server is not a process of this machine")
            else:
                server_pids = partial(list, local)
        tokenmill = TokenmillTarget(client, constraint=_constraint(args))
        targets: list[Target] = [tokenmill]
        peer_props = None
        if peer is not None:
            peer_props = await peer.props()
            targets.append(peer)
        sides = {target.name: SideRun() for target in targets}
        common: dict[str, Any] = {
            "prompt_tokens": args.prompt_tokens,
            "vocab_size": info.vocab_size,
            "shared_prompt": args.shared_prompt,
            "timeout": args.request_timeout,
        }
        if args.warmup > 0:
            for target in targets:
                log.info("warmup", side=target.name, requests=args.warmup)
                # Full-size requests: the first one is reported as the cold request beside the steady state.
                warm = await run_level(
                    target,
                    concurrency=1,
                    num_requests=args.warmup,
                    output_tokens=args.output_tokens,
                    label="warmup",
                    # Below the 20,000 first ids prompt_ids cycles through and above any run's request count, so
                    # no level repeats a warm-up prompt (900,000 did: 0 modulo 20,000 gave request 0's prompt).
                    first_index=WARMUP_FIRST_INDEX,
                    **common,
                )
                sides[target.name].first_request = warm.records[0]
                if warm.failed:
                    log.warning("warmup_failed", side=target.name, errors=warm.errors())

        def level_of(target: Target, concurrency: int, requests: int, first: int) -> Awaitable[LevelResult]:
            is_tokenmill = target is tokenmill
            return run_level(
                target,
                concurrency=concurrency,
                num_requests=requests,
                output_tokens=args.output_tokens,
                label=f"c{concurrency}",
                first_index=first,
                ramp_s=args.ramp_s if concurrency > 1 else 0.0,
                monitor=partial(sample_engine, client, period=1.0, server_pids=server_pids) if is_tokenmill else None,
                server_pids=server_pids if is_tokenmill else None,
                **common,
            )

        first_index = 0
        for concurrency in sorted(set(args.concurrency) | {1}):
            n = max(concurrency * args.rounds, args.min_requests)
            levels: dict[str, LevelResult] = {}
            if concurrency == 1 and len(targets) > 1:  # a request a side in turn (run_in_turns says why)
                log.info("level_start", side="each in turn", concurrency=1, requests=n)
                levels = await run_in_turns(targets, n, first_index, lambda target, i: level_of(target, 1, 1, i))
            for target in targets:
                if target.name not in levels:
                    log.info("level_start", side=target.name, concurrency=concurrency, requests=n)
                    levels[target.name] = await level_of(target, concurrency, n, first_index)
                level = levels[target.name]
                log.info(
                    "level_done",
                    side=target.name,
                    concurrency=concurrency,
                    tok_s=round(level.throughput_tok_s, 1),
                    wall_s=round(level.wall_s, 1),
                    failed=level.failed,
                    other_load_cores=None if (o := level.other_load_cores) is None else round(o, 2),
                )
                side = sides[target.name]
                if concurrency == 1:
                    side.single = level
                    read_now = await asyncio.to_thread(read_bandwidth, args.copy_buffer_mib * 2**20)
                    side.single_read_gbs = read_now["gbs"]
                    log.info("read_bandwidth_beside_single", side=target.name, gbs=round(read_now["gbs"], 2))
                if concurrency in args.concurrency:
                    side.levels.append(level)
            first_index += n

        for length in args.long_prompts:
            ids = random_prompt_ids(length, seed=args.long_prompt_seed + length, vocab_size=info.vocab_size)
            for target in targets:
                log.info("long_prompt", side=target.name, prompt_tokens=length)
                record = await target.request(800_000 + length, ids, 1, args.request_timeout, f"long{length}")
                if record.error is not None:
                    log.warning("long_prompt_failed", side=target.name, prompt_tokens=length, error=record.error)
                sides[target.name].long_prompts.append(_long_prompt_row(length, record))
        info_after = await client.model_info(timeout=30.0)
    model_info = {
        "name": info.name,
        "context_length": info.context_length,
        "vocab_size": info.vocab_size,
        "backend": info.backend,
        "device": info.device,
        "dtype": info.dtype,
        "quantization": info.quantization,
        "weight_bytes": info.weight_bytes,
        "num_workers": info.num_workers,
        "max_batch_size": info.limits.max_batch_size,
        "max_queue": info.limits.max_queue,
        "kv_blocks_total": info.engine.kv_blocks_total,
        "kv_block_size": info.engine.kv_block_size,
        "worker_restarts_after": sum(w.restarts for w in info_after.workers),
    }
    return Measured(model_info, sides, peer_props)


def run(args: argparse.Namespace) -> int:
    started = time.monotonic()
    timestamp = datetime.now(timezone.utc).isoformat(timespec="seconds")
    # The machine may be shared: a high load average around the run explains noisy numbers.
    load_at_start = loadavg()
    # Measured before the server loads, so the copy has the memory system to itself.
    log.info("copy_bandwidth", buffer_mib=args.copy_buffer_mib)
    copy = copy_bandwidth(args.copy_buffer_mib * 2**20)
    log.info("copy_bandwidth_done", gbs=round(copy["gbs"], 2), method=copy["method"])
    read = read_bandwidth(args.copy_buffer_mib * 2**20)
    log.info("read_bandwidth_done", gbs=round(read["gbs"], 2), method=read["method"])

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
        server = ManagedServer(server_args, args.server_log)
        log.info("server_starting", args=" ".join(server_args) or "(defaults)", log=server.log_path)
        try:
            server.start()
        except (RuntimeError, FileNotFoundError) as exc:
            sys.stderr.write(f"tokenmill-bench: error: could not start the server (log: {server.log_path}): {exc}\n")
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
    peer_errors: tuple[type[BaseException], ...] = ()  # catches nothing
    if args.peer is not None:
        from tokenmill_bench.llama_server import PEER_ERRORS as peer_errors
    try:
        measured = asyncio.run(_measure(address, args, pids))
    except TokenmillError as exc:
        sys.stderr.write(f"tokenmill-bench: error: {address}: {exc}\n")
        return 2
    except peer_errors as exc:  # the peer unreachable, or not answering /props
        sys.stderr.write(f"tokenmill-bench: error: peer {args.peer[1]}: {exc!r}\n")
        return 2
    finally:
        if server is not None:
            server_exit = server.stop()
            server.close()
    model_info = measured.model_info
    ours = measured.sides["tokenmill"]
    single, levels = ours.single, ours.levels
    assert single is not None
    machine = machine_info(model_info["device"])
    machine["loadavg_at_start"], machine["loadavg_at_end"] = load_at_start, loadavg()

    total_weight_bytes: int | None = args.weight_bytes
    if total_weight_bytes is None and model_info["weight_bytes"]:
        # The server's own count: quantized layers at their stored size, what one step reads.
        total_weight_bytes = int(model_info["weight_bytes"])
    elif parameters and model_path is not None:
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

    single_summary = single.summary()
    level_summaries = [level.summary() for level in levels]
    result: dict[str, Any] = {
        "tool": "tokenmill-bench",
        "timestamp": timestamp,
        **headline(single_summary, level_summaries, total_weight_bytes),
        "copy_bandwidth_gbs": copy["gbs"],
        "read_bandwidth_gbs": read["gbs"],
        **_beside_single(side=ours, weight_bytes=total_weight_bytes),
        "failed_requests": single.failed + sum(level.failed for level in levels if level is not single),
        "bandwidth_convention": "model weight bytes x single-stream decode tok/s (every weight read once per token)",
        "copy_bandwidth": copy,
        "read_bandwidth": read,
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
            "long_prompts": args.long_prompts,
            "long_prompt_seed": args.long_prompt_seed,
            "request_timeout_s": args.request_timeout,
            "sampling": "greedy (temperature 0), ignore_eos",
            "constraint": _constraint(args),
            "single_stream_from": "the concurrency-1 level",
        },
        "single_stream": single_summary,
        "levels": level_summaries,
        "first_request": _request_row(ours.first_request),
        "long_prompts": ours.long_prompts,
        "peer": None,
        "duration_s": time.monotonic() - started,
    }
    if args.peer is not None:
        result["peer"] = _peer_section(args.peer, measured, model_path)
        result["comparison"] = _comparison(result)
        result["duration_s"] = time.monotonic() - started
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
    log.info(
        "done",
        seconds=round(result["duration_s"], 1),
        failed_requests=result["failed_requests"],
        server_log=server.log_path if server is not None else None,
    )
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
    peer = result.get("peer") or {}
    if peer.get("failed_requests"):
        warnings.append(f"{peer['failed_requests']} requests to the peer ({peer['name']}) failed; see peer.levels")
    if peer.get("weight_bytes_note"):
        warnings.append(f"peer bandwidth: {peer['weight_bytes_note']}")
    exit_code = result["server"].get("exit_code")
    if exit_code not in (None, 0):
        warnings.append(f"the started server exited with code {exit_code}")
    return list(dict.fromkeys(warnings))


def _request_row(record: RequestRecord | None) -> dict[str, Any] | None:
    if record is None:
        return None
    from tokenmill_bench.load import request_row

    return request_row(record)


def _peer_section(spec: tuple[str, str], measured: Measured, model_path: Path | None) -> dict[str, Any]:
    """The peer's own figures, in the same shape as tokenmill's, and the bytes it reads per decode step."""
    name, url = spec
    side = measured.sides[name]
    assert side.single is not None
    props = measured.peer_props or {}
    served = props.get("model_path")
    weight_file = Path(served) if isinstance(served, str) and Path(served).is_file() else model_path
    note = None
    if weight_file is None or weight_file.is_dir():
        weight_file, note = None, "the peer's GGUF is not readable here; bandwidth not counted"
    elif served and Path(served).name != weight_file.name:
        note = f"the peer serves {Path(served).name}, not {weight_file.name}; bandwidth not counted"
        weight_file = None
    peer_weight_bytes = None
    if weight_file is not None:
        try:
            peer_weight_bytes = gguf_tensor_bytes(weight_file)
        except (ImportError, OSError, ValueError) as exc:
            note = f"cannot count the tensor bytes of {weight_file}: {exc}"
    levels = [level.summary() for level in side.levels]
    return {
        "name": name,
        "url": url,
        "model_path": served,
        "build": props.get("build_info"),
        "total_slots": props.get("total_slots"),
        "n_ctx": (props.get("default_generation_settings") or {}).get("n_ctx"),
        "weight_bytes": peer_weight_bytes,
        "weight_bytes_note": note,
        "weight_bytes_convention": "GGUF tensor bytes as stored (llama.cpp computes on the quantized blocks), "
        "a mixture of experts' expert tensors by the share a token chooses",
        "request": "POST /completion: token-id prompt, n_predict, stream, ignore_eos, temperature 0, top_k 1, "
        "cache_prompt true",
        "failed_requests": side.single.failed + sum(level.failed for level in side.levels if level is not side.single),
        "single_stream": side.single.summary(),
        **_beside_single(side=side, weight_bytes=peer_weight_bytes),
        "levels": levels,
        "first_request": _request_row(side.first_request),
        "long_prompts": side.long_prompts,
    }


def _beside_single(side: SideRun, weight_bytes: int | None) -> dict[str, Any]:
    """A side's single-stream bandwidth against the read rate measured right after it."""
    assert side.single is not None
    steps_per_s = side.single.summary()["per_stream_decode_tok_s"] or None
    achieved = weight_bytes * steps_per_s / 1e9 if weight_bytes and steps_per_s else None
    gbs = side.single_read_gbs
    return {
        "read_bandwidth_beside_single_gbs": gbs,
        "bandwidth_share_beside_single": achieved / gbs if achieved is not None and gbs else None,
    }


def _comparison(result: dict[str, Any]) -> dict[str, Any]:
    from tokenmill_bench.comparison import compare_first_requests, compare_levels, compare_long_prompts

    peer = result["peer"]
    return {
        "peer": peer["name"],
        "ratio": "tokenmill / peer",
        "read_bandwidth_gbs": result["read_bandwidth_gbs"],
        "weight_bytes": {"tokenmill": result["model"]["weight_bytes"], "peer": peer["weight_bytes"]},
        "single_stream_beside": {
            name: {"read_gbs": side["read_bandwidth_beside_single_gbs"], "share": side["bandwidth_share_beside_single"]}
            for name, side in (("tokenmill", result), ("peer", peer))
        },
        "levels": compare_levels(
            result["levels"],
            peer["levels"],
            weight_bytes=result["model"]["weight_bytes"],
            peer_weight_bytes=peer["weight_bytes"],
            read_gbs=result["read_bandwidth_gbs"],
        ),
        "first_request": compare_first_requests(
            {"tokenmill": result["first_request"], "peer": peer["first_request"]},
            {"tokenmill": result["single_stream"], "peer": peer["single_stream"]},
        ),
        "long_prompts": compare_long_prompts(result["long_prompts"], peer["long_prompts"]),
    }


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


def _constraint(args: argparse.Namespace) -> dict[str, str] | None:
    """--json-schema / --regex as the client's options; None: free text."""
    if getattr(args, "json_schema", None) is not None:
        return {"json_schema": args.json_schema.read_text(encoding="utf-8")}
    if getattr(args, "regex", None) is not None:
        return {"regex": args.regex}
    return None


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments[:1] == ["plot"]:
        return plot_main(arguments[1:])
    if arguments[:1] == ["table"]:
        return table_main(arguments[1:])
    if arguments[:1] == ["shaped"]:
        from tokenmill_bench.shaped import shaped_main

        return shaped_main(arguments[1:])
    if arguments[:1] == ["structured"]:
        from tokenmill_bench.structured import structured_main

        return structured_main(arguments[1:])
    if arguments[:1] == ["routing"]:
        from tokenmill_bench.routing import routing_main

        return routing_main(arguments[1:])
    if arguments[:1] == ["lora"]:
        from tokenmill_bench.lora import lora_main

        return lora_main(arguments[1:])
    if arguments[:1] == ["results"]:
        from tokenmill_bench.results_table import results_main

        return results_main(arguments[1:])
    if arguments[:1] == ["run"]:
        arguments = arguments[1:]
    args = build_parser().parse_args(arguments)
    if args.concurrency is None:
        args.concurrency = list(PEER_CONCURRENCY if args.peer else DEFAULT_CONCURRENCY)
    if args.long_prompts is None:
        args.long_prompts = list(DEFAULT_LONG_PROMPTS) if args.peer else []
    if args.long_prompt_seed is None:
        args.long_prompt_seed = random.SystemRandom().randrange(1 << 31)
    configure_logging(args.quiet)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
