"""``generate --input-file``: a file of prompts, one a line, run concurrently and printed in input order."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Any, TextIO

from .._types import GenerateResult
from ..errors import TokenmillError
from .connect import client_from_args
from .options import GenSettings
from .report import EXIT_FAILED, UsageError, describe_error, err, error_line, out, tool_call_json, tool_call_lines


@dataclass
class _Outcome:
    result: GenerateResult | None = None
    error: str | None = None
    done: bool = False


def _print_outcome(args: argparse.Namespace, index: int, prompt: str, outcome: _Outcome) -> None:
    if outcome.error is not None:
        error_line(f"prompt {index + 1}: {outcome.error}")
    if args.json:
        record: dict[str, Any] = {"index": index, "prompt": prompt}
        if outcome.result is not None:
            record.update(
                request_id=outcome.result.request_id,
                completion=outcome.result.text,
                finish_reason=outcome.result.finish_reason.value,
                usage=dataclasses.asdict(outcome.result.usage),
                timing=dataclasses.asdict(outcome.result.timing),
            )
            if outcome.result.tool_calls:
                record["tool_calls"] = [tool_call_json(c) for c in outcome.result.tool_calls]
        else:
            record["error"] = outcome.error
        out(json.dumps(record, ensure_ascii=False) + "\n")
    elif outcome.result is not None:
        calls = tool_call_lines(outcome.result.tool_calls)
        out(f"Prompt: {prompt}\nCompletion: {outcome.result.text}\n{calls}\n")
    else:
        out(f"Prompt: {prompt}\nError: {outcome.error}\n\n")


class _Progress:
    """A one-line progress bar on stderr."""

    def __init__(self, total: int, stream: TextIO, width: int = 30) -> None:
        self.total, self.done, self.failed = total, 0, 0
        self._stream, self._width = stream, width
        self._lock = threading.Lock()

    def update(self, failed: bool) -> None:
        with self._lock:
            self.done += 1
            self.failed += failed
            self.draw()

    def draw(self) -> None:
        filled = self._width * self.done // max(self.total, 1)
        bar = "#" * filled + "-" * (self._width - filled)
        failed = f", {self.failed} failed" if self.failed else ""
        self._stream.write(f"\r[{bar}] {self.done}/{self.total}{failed}")
        self._stream.flush()

    def finish(self) -> None:
        self._stream.write("\n")
        self._stream.flush()


def _read_prompts(path: str) -> list[str]:
    try:
        if path == "-":
            lines = sys.stdin.read().splitlines()
        else:
            with open(path, encoding="utf-8") as f:
                lines = f.read().splitlines()
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise UsageError(f"{path} is not UTF-8 text: {exc.reason}") from exc
    return [line.strip() for line in lines if line.strip()]


def generate_from_file(args: argparse.Namespace, settings: GenSettings) -> int:
    prompts = _read_prompts(args.input_file)
    if not prompts:
        raise UsageError(f"no prompts in {args.input_file} (one prompt per line; blank lines are skipped)")
    if not args.quiet:
        err(f"[server={args.server} {len(prompts)} prompts concurrency={args.concurrency} {settings.summary()}]\n")
    outcomes = [_Outcome() for _ in prompts]
    # A progress bar is for a person watching: not in a log file, not with -q.
    progress = _Progress(len(prompts), sys.stderr) if sys.stderr.isatty() and not args.quiet else None
    if progress is not None:
        progress.draw()
    printed = 0

    def print_ready() -> None:
        """Print, in input order, every outcome whose predecessors are all printed."""
        nonlocal printed
        while printed < len(prompts) and outcomes[printed].done:
            if progress is not None:
                err("\r\033[K")  # the bar is redrawn below the output
            _print_outcome(args, printed, prompts[printed], outcomes[printed])
            printed += 1

    with client_from_args(args) as client:

        def run_one(prompt: str) -> GenerateResult:
            if settings.raw:
                return settings.complete(client, prompt, None)
            return settings.complete(client, None, settings.messages((), prompt))

        pool = ThreadPoolExecutor(max_workers=args.concurrency, thread_name_prefix="tokenmill-client")
        try:
            futures: dict[Future[GenerateResult], int] = {pool.submit(run_one, p): i for i, p in enumerate(prompts)}
            for future in as_completed(futures):
                index = futures[future]
                try:
                    outcomes[index].result = future.result()
                except TokenmillError as exc:
                    outcomes[index].error = describe_error(exc)
                outcomes[index].done = True
                print_ready()
                if progress is not None:
                    progress.update(failed=outcomes[index].error is not None)
        except KeyboardInterrupt:
            pool.shutdown(wait=False, cancel_futures=True)
            if progress is not None:
                progress.finish()
            raise
        pool.shutdown()
    if progress is not None:
        progress.finish()
    failed = sum(o.error is not None for o in outcomes)
    if failed:
        err(f"{failed} of {len(prompts)} prompts failed\n")
    return EXIT_FAILED if failed else 0
