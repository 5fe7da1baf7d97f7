"""``tokenmill-client generate``: one prompt streamed, several answers to it, or (elsewhere) a chat or a file."""

from __future__ import annotations

import argparse
import sys

from .._types import GenerateEvent
from .batch import generate_from_file
from .connect import client_from_args
from .options import GenSettings, output_mode, settings_from_args
from .repl import Repl
from .report import UsageError, err, out, stats_line, token_line, tool_call_lines
from .stream import stream_answer


def cmd_generate(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    if settings.raw and settings.system:
        raise UsageError("--system cannot be used with --raw (a raw prompt is sent as it is)")
    if args.concurrency < 1:
        raise UsageError("--concurrency must be at least 1")
    if args.n < 1:
        raise UsageError("-n must be at least 1")
    if args.n > 1 and (args.interactive or args.input_file is not None):
        raise UsageError("-n gives several answers to one prompt; it does not go with -i or --input-file")
    if args.interactive:
        with client_from_args(args) as client:
            return Repl(client, settings, mode=output_mode(args)).run()
    if args.input_file is not None:
        return generate_from_file(args, settings)
    prompt = _prompt_from_args(args)
    if not args.quiet:
        kind = "raw prompt" if settings.raw else "chat" + (" with system message" if settings.system else "")
        err(f"[server={args.server} {kind} {settings.summary()}]\n")
    if args.n > 1 and not args.json:
        return _print_choices(args, settings, prompt)
    with client_from_args(args) as client:
        last, _text = stream_answer(
            client,
            settings,
            prompt=prompt if settings.raw else None,
            messages=None if settings.raw else settings.messages((), prompt),
            mode=output_mode(args),
        )
    if last is not None and not args.quiet and not args.json:
        err(stats_line(last))
    return 0


def _prompt_from_args(args: argparse.Namespace) -> str:
    """The prompt: -p, the positional argument, or standard input when it is not a terminal."""
    prompt: str | None = args.prompt if args.prompt is not None else args.prompt_arg
    if prompt is None or prompt == "-":
        given = prompt == "-"
        # The line break `echo` or a file ends with is not part of the prompt.
        prompt = "" if prompt is None and sys.stdin.isatty() else sys.stdin.read().rstrip("\r\n")
        if not prompt and not given:  # nothing at all: no prompt was meant to be given this way
            raise UsageError(
                "missing prompt: give it as an argument, with -p, on standard input, "
                "or use -i for an interactive session or --input-file FILE"
            )
    if not prompt.strip():
        raise UsageError("the prompt is empty")
    return prompt


def _print_choices(args: argparse.Namespace, settings: GenSettings, prompt: str) -> int:
    """-n N (text or --show-tokens): each answer whole, under a [choice I] line, in order. (With --json
    the events stream as they come, each with its choice's index.)"""
    with client_from_args(args) as client:
        results = client.generate_choices(
            prompt if settings.raw else None,
            messages=None if settings.raw else settings.messages((), prompt),
            options=settings.options,
        )
    for index, result in enumerate(results):
        out(f"[choice {index}]\n")
        if output_mode(args) == "tokens":
            out("".join(token_line(t) for t in result.tokens))
        else:
            out(result.text if result.text.endswith("\n") else result.text + "\n")
            out(tool_call_lines(result.tool_calls))
        if not args.quiet:
            err(
                stats_line(
                    GenerateEvent(
                        result.request_id,
                        "",
                        finish_reason=result.finish_reason,
                        usage=result.usage,
                        timing=result.timing,
                        index=index,
                    )
                )
            )
    return 0
