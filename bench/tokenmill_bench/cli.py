"""`tokenmill-bench`: single-stream latency, throughput under concurrency and memory bandwidth, over gRPC.

tokenmill-bench [--server ADDRESS] [--json PATH] [--plot PNG] [options]   # measure
tokenmill-bench plot RESULTS.json OUT.png                                 # redraw the plot
tokenmill-bench lora [options]                                            # adapters against the base
tokenmill-bench results [--check]                                         # bench/RESULTS.md from bench/results/

The measuring run's flags are in arguments.py, its steps in run.py (measure.py the measurement itself,
results.py the document it writes); each other command has a module of its own.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import structlog

from tokenmill_bench.arguments import parse_run_args
from tokenmill_bench.report import format_tables
from tokenmill_bench.run import run


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
    args = parse_run_args(arguments)
    configure_logging(args.quiet)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
