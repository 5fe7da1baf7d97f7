"""The measuring run's command line (`tokenmill-bench [run] [options]`): its flags and their defaults."""

from __future__ import annotations

import argparse
import random
from collections.abc import Sequence
from pathlib import Path

PEERS = ("llama-server",)
DEFAULT_CONCURRENCY = (1, 4, 16, 64)
# Each level runs twice with a peer: fewer levels keep the run about as long.
PEER_CONCURRENCY = (1, 16, 64)
DEFAULT_LONG_PROMPTS = (1000, 4000)


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
    _server_flags(parser)
    _load_flags(parser)
    _result_flags(parser)
    return parser


def _server_flags(parser: argparse.ArgumentParser) -> None:
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


def _load_flags(parser: argparse.ArgumentParser) -> None:
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


def _result_flags(parser: argparse.ArgumentParser) -> None:
    out = parser.add_argument_group("results")
    out.add_argument("--weight-bytes", type=int, help="model weight bytes (default: counted from the model file)")
    out.add_argument(
        "--copy-buffer-mib",
        type=_positive,
        help="buffer for the memory copy and read measurements (default: 256, or twice the CPU's last-level cache "
        "where that is larger, so that they measure memory rather than the cache)",
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
        "--long-prompt-tries",
        type=_positive,
        default=1,
        metavar="N",
        help="prompts per long-prompt length, each of its own random ids (no cached prefix), the sides in turn; "
        "each side's median time is the length's figure (default 1)",
    )
    parser.add_argument(
        "--prompt-seed",
        type=int,
        default=None,
        help="seed of the levels' prompts (default: a fresh one each run, so that no cache kept from an earlier "
        "run, such as a llama-server's slots, has seen them; the JSON records it)",
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


def parse_run_args(arguments: Sequence[str]) -> argparse.Namespace:
    """The run's flags, with the defaults that depend on other flags (--peer) or on chance filled in."""
    args = build_parser().parse_args(arguments)
    if args.concurrency is None:
        args.concurrency = list(PEER_CONCURRENCY if args.peer else DEFAULT_CONCURRENCY)
    if args.long_prompts is None:
        args.long_prompts = list(DEFAULT_LONG_PROMPTS) if args.peer else []
    if args.prompt_seed is None:
        args.prompt_seed = random.SystemRandom().randrange(1 << 31)
    if args.long_prompt_seed is None:
        args.long_prompt_seed = random.SystemRandom().randrange(1 << 31)
    return args


def constraint(args: argparse.Namespace) -> dict[str, str] | None:
    """--json-schema / --regex as the client's options; None: free text."""
    if getattr(args, "json_schema", None) is not None:
        return {"json_schema": args.json_schema.read_text(encoding="utf-8")}
    if getattr(args, "regex", None) is not None:
        return {"regex": args.regex}
    return None
