"""``tokenmill-client``: generate (one-shot, interactive or from a file), info, tokenize and health.

Output goes to stdout; the settings summary, progress, statistics and errors go to stderr. An error is
one ``error: ...`` line and a non-zero exit code (1 for a failed call, 2 for bad usage, 130 for Ctrl-C).
Standard library only, besides the client itself.

One module a concern: ``parser`` (the flags), ``connect`` (the connection), ``options`` (the generate
settings), ``generate``, ``batch`` (--input-file), ``repl`` (-i), ``info`` (info, tokenize, health),
``stream`` and ``report`` (what is written where).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from ..errors import TokenmillError
from .options import GenSettings, options_from_args
from .parser import build_parser
from .repl import Repl
from .report import (
    EXIT_BROKEN_PIPE,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    UsageError,
    describe_error,
    err,
    error_line,
    flag_names,
)

__all__ = [
    "GenSettings",
    "Repl",
    "UsageError",
    "build_parser",
    "describe_error",
    "flag_names",
    "main",
    "options_from_args",
]


def _parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """Like parse_args, but an unknown option is reported with its command's usage, not the top level's."""
    args, extras = parser.parse_known_args(argv)
    if extras:
        commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        commands.choices[args.command].error(f"unrecognized arguments: {' '.join(extras)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = _parse(parser, argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except UsageError as exc:
        error_line(str(exc))
        return EXIT_USAGE
    except TokenmillError as exc:
        error_line(describe_error(exc))
        return EXIT_FAILED
    except KeyboardInterrupt:
        err("\n")
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (e.g. `| head`): stop quietly, without a second error at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
