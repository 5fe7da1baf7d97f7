"""``tokenmill-client``: generate (one-shot, interactive or from a file), info, tokenize and health.

Output goes to stdout; the settings summary, progress, statistics and errors go to stderr. An error is
one ``error: ...`` line and a non-zero exit code (1 for a failed call, 2 for bad usage, 130 for Ctrl-C).
Standard library only, besides the client itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys
import threading
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from ._transport import LOAD_BALANCING_POLICIES, default_target
from ._types import (
    ChatMessage,
    FinishReason,
    FunctionChoice,
    GenerateEvent,
    GenerateOptions,
    GenerateOverrides,
    GenerateResult,
    ModelInfo,
    Token,
    Tool,
    ToolCall,
    ToolChoice,
)
from .client import Client
from .errors import (
    AuthenticationError,
    DeadlineExceededError,
    InvalidRequestError,
    OverloadedError,
    TokenmillError,
    UnavailableError,
)

if TYPE_CHECKING:
    from typing_extensions import Unpack  # annotations only: typing.Unpack needs Python 3.11

ENV_TOKEN = "TOKENMILL_TOKEN"
ENV_LOAD_BALANCING = "TOKENMILL_LOAD_BALANCING"
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, as a shell reports a process killed by it


class UsageError(Exception):
    """A bad command line: reported as one line, exit code 2."""


# ---------------------------------------------------------------------------------------------- output


def _out(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _err(text: str) -> None:
    sys.stderr.write(text)
    sys.stderr.flush()


def _error_line(message: str) -> None:
    _err(f"error: {' '.join(message.split())}\n")


# gRPC's wording when no connection could be made (as opposed to a server that answered UNAVAILABLE).
_CONNECTION_FAILURES = ("failed to connect", "connection refused", "errors resolving", "dns resolution failed")


# The server names the GenerateRequest's fields; a CLI user set them with these flags.
_FLAGS = {
    "max_new_tokens": "--max-new-tokens",
    "sampling.temperature": "--temperature",
    "sampling.top_k": "--top-k",
    "sampling.top_p": "--top-p",
    "sampling.repetition_penalty": "--repetition-penalty",
    "sampling.presence_penalty": "--presence-penalty",
    "sampling.frequency_penalty": "--frequency-penalty",
    "sampling.logit_bias": "--logit-bias",
    "sampling.seed": "--seed",
    "stopping.stop": "--stop",
    "json_schema": "--json-schema",
    "regex": "--regex",
    "grammar.text": "--grammar",
}
_FIELD = re.compile(
    r"(?<![\w.])(?:stopping\.)?max_new_tokens\b|(?<![\w.])(?:sampling\.\w+|stopping\.stop)\b"
    r"|(?<![\w.])(?:json_schema|regex|grammar\.text)(?=:)"
)


def flag_names(message: str) -> str:
    """The server's message with each request field it names written as the flag that sets it."""
    return _FIELD.sub(lambda m: _FLAGS.get(m.group(), _FLAGS.get(m.group().rpartition(".")[2], m.group())), message)


def describe_error(err: TokenmillError) -> str:
    """One line for a failed call, naming the server for connection problems."""
    if isinstance(err, UnavailableError):
        if any(sign in err.message.lower() for sign in _CONNECTION_FAILURES):
            return f"cannot reach the server at {err.target}: {err.message}"
        return f"the server at {err.target} is unavailable: {err.message}"
    if isinstance(err, InvalidRequestError):
        return f"invalid request: {flag_names(err.message)}"
    if isinstance(err, OverloadedError):
        return f"server overloaded: {err.message}"
    if isinstance(err, DeadlineExceededError):
        return f"timed out: {err.message}"
    if isinstance(err, AuthenticationError):
        return f"authentication failed: {err.message}"
    code = err.code.name if err.code is not None else "ERROR"
    return f"{code}: {err.message}"


def _jsonable(value: Any) -> Any:
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) and not isinstance(value, type) else value


def _json_line(value: Any) -> str:
    return json.dumps(_jsonable(value), ensure_ascii=False) + "\n"


def _tool_call_json(call: ToolCall) -> dict[str, Any]:
    """A call in OpenAI's shape (what an assistant message of a later request's history carries)."""
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def _tool_call_lines(calls: Sequence[ToolCall]) -> str:
    return "".join(json.dumps(_tool_call_json(c), ensure_ascii=False) + "\n" for c in calls)


def _fmt_logprob(token: Token) -> str:
    return "-" if token.logprob is None else f"{token.logprob:.4f}"


def _token_line(token: Token) -> str:
    return f"{token.text!r}\t{_fmt_logprob(token)}\n"


def _fmt_num(value: float) -> str:
    return f"{value:g}"


# --------------------------------------------------------------------------------------------- settings


@dataclass
class GenSettings:
    """The generate command's settings (the REPL edits them): the generate options and how prompts are sent."""

    options: GenerateOptions = field(default_factory=GenerateOptions)
    system: str | None = None
    raw: bool = False

    def stream(
        self, client: Client, prompt: str | None, messages: Sequence[ChatMessage] | None
    ) -> Generator[GenerateEvent, None, None]:
        return client.generate(prompt, messages=messages, options=self.options)

    def complete(self, client: Client, prompt: str | None, messages: Sequence[ChatMessage] | None) -> GenerateResult:
        return client.generate_text(prompt, messages=messages, options=self.options)

    def summary(self) -> str:
        o = self.options
        parts = [
            f"temperature={_fmt_num(o.temperature)}" + (" (greedy)" if o.temperature == 0 else ""),
            f"top_k={o.top_k or 'off'}",
            f"top_p={'off' if o.top_p in (0.0, 1.0) else _fmt_num(o.top_p)}",
        ]
        if o.repetition_penalty not in (0.0, 1.0):
            parts.append(f"repetition_penalty={_fmt_num(o.repetition_penalty)}")
        if o.presence_penalty:
            parts.append(f"presence_penalty={_fmt_num(o.presence_penalty)}")
        if o.frequency_penalty:
            parts.append(f"frequency_penalty={_fmt_num(o.frequency_penalty)}")
        if o.logit_bias:
            parts.append("logit_bias=" + ",".join(f"{t}={_fmt_num(b)}" for t, b in sorted(o.logit_bias.items())))
        parts.append(f"limit={o.max_new_tokens or 'server default'}")
        parts.append(f"seed={'random' if o.seed is None else o.seed}")
        if o.stop:
            parts.append(f"stop={list(o.stop)!r}")
        if o.ignore_eos:
            parts.append("ignore_eos")
        return " ".join(parts)

    def messages(self, history: Sequence[ChatMessage], user: str) -> list[ChatMessage]:
        system = [ChatMessage("system", self.system)] if self.system else []
        return [*system, *history, ChatMessage("user", user)]


def options_from_args(args: argparse.Namespace) -> GenerateOptions:
    """The generate command's flags as one GenerateOptions.

    --timeout is not among them: it is the client's default deadline, for every command.
    """
    grammar = _read_file(args.grammar) if args.grammar else None
    tools = _read_tools(args.tools) if args.tools else ()
    if args.tool_choice is not None and not tools:
        raise UsageError("--tool-choice needs --tools")
    if tools and args.raw:
        raise UsageError("--tools needs a chat (the chat template offers them); it does not go with --raw")
    return GenerateOptions(
        max_new_tokens=args.limit,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        logit_bias=dict(args.logit_bias),
        seed=args.seed,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
        logprobs=_output_mode(args) == "tokens",  # --show-tokens prints each token's logprob
        json_schema=_read_file(args.json_schema) if args.json_schema else None,
        json_object=args.json_object,
        regex=args.regex,
        grammar=grammar,
        grammar_syntax="gbnf" if grammar is not None and "::=" in grammar else "lark",
        adapter=args.adapter,
        n=args.n,
        tools=tools,
        tool_choice=_tool_choice(args.tool_choice or "auto", tools),
        parallel_tool_calls=False if args.no_parallel_tool_calls else None,
    )


def _read_tools(path: str) -> tuple[Tool, ...]:
    """--tools FILE: a JSON list of OpenAI-style function tools."""
    try:
        data = json.loads(_read_file(path))
    except json.JSONDecodeError as exc:
        raise UsageError(f"--tools {path} is not valid JSON: {exc}") from None
    if not isinstance(data, list):
        raise UsageError(f"--tools {path} must hold a JSON list of tools")
    try:
        return tuple(Tool.from_openai(t) for t in data)
    except (TypeError, ValueError) as exc:
        raise UsageError(f"--tools {path}: {exc}") from None


def _tool_choice(text: str, tools: Sequence[Tool]) -> ToolChoice:
    """--tool-choice auto|none|required|NAME (NAME: one of the tools' functions)."""
    if text in ("auto", "none", "required"):
        return text  # type: ignore[return-value]
    if not any(t.name == text for t in tools):
        names = ", ".join(t.name for t in tools)
        raise UsageError(f"--tool-choice {text!r} is not auto, none, required or one of the tools ({names})")
    return FunctionChoice(text)


def _read_file(path: str) -> str:
    """A constraint flag's file ("-": standard input is not allowed, it holds the prompts)."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise SystemExit(f"tokenmill-client: cannot read {path}: {exc.strerror}") from None


def _settings_from_args(args: argparse.Namespace) -> GenSettings:
    return GenSettings(options=options_from_args(args), system=args.system, raw=args.raw)


# Enough retries to wait out a normal start of the server (the embedded model: about 10 s warm, 30 s cold):
# 0.2, 0.4, 0.8, 1.6 s, then 2 s apart (each +-20 %), about 35 s in all.
DEFAULT_MAX_RETRIES = 20
# gRPC's own reconnection backoff grows to 120 s; capped so a server that starts listening is reached soon.
_CHANNEL_OPTIONS = (("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 2000))


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
        _err(f"waiting for the server at {self.target} (unavailable; retrying up to --max-retries times)...\n")


# With round_robin the CLI waits this long for every address before its first call (--wait-for-addresses).
ROUND_ROBIN_WAIT_SECONDS = 5.0


def _client_from_args(args: argparse.Namespace) -> Client:
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
            _err(
                f"connected to {connections.ready} of the {connections.total} addresses of {client.target} "
                f"after {wait:g} s; calls go to those\n"
            )
    return client


def _stats_line(event: GenerateEvent) -> str:
    usage, timing = event.usage, event.timing
    parts = [f"finish={event.finish_reason}"]
    if usage is not None:
        parts.append(f"prompt_tokens={usage.prompt_tokens} completion_tokens={usage.completion_tokens}")
    if timing is not None:
        parts.append(f"ttft_ms={timing.time_to_first_token_ms:.1f} total_ms={timing.total_ms:.1f}")
    return "[" + " ".join(parts) + "]\n"


# ---------------------------------------------------------------------------------------------- generate


def _stream_answer(
    client: Client, settings: GenSettings, *, prompt: str | None, messages: Sequence[ChatMessage] | None, mode: str
) -> tuple[GenerateEvent | None, str]:
    """Streams one generation to stdout (text, one line per token, or JSON lines).

    Returns the last event and the whole text. Ctrl-C propagates as KeyboardInterrupt once the call is cancelled.
    """
    stream = settings.stream(client, prompt, messages)
    last: GenerateEvent | None = None
    text: list[str] = []
    ends_with_newline = True
    try:
        for event in stream:
            text.append(event.text)
            if mode == "json":
                _out(_json_line(event))
            elif mode == "tokens":
                _out("".join(_token_line(t) for t in event.tokens))
            elif event.text:
                _out(event.text)
                ends_with_newline = event.text.endswith("\n")
            if event.is_last:
                last = event
    finally:
        stream.close()  # cancels the call if we are leaving early (Ctrl-C, a broken pipe)
        if mode == "text" and not ends_with_newline:
            _out("\n")
    if mode == "text" and last is not None and last.tool_calls:
        _out(_tool_call_lines(last.tool_calls))  # one JSON line per call, after the text they were read from
    return last, "".join(text)


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


def _output_mode(args: argparse.Namespace) -> str:
    return "json" if args.json else "tokens" if args.show_tokens else "text"


def cmd_generate(args: argparse.Namespace) -> int:
    settings = _settings_from_args(args)
    if settings.raw and settings.system:
        raise UsageError("--system cannot be used with --raw (a raw prompt is sent as it is)")
    if args.concurrency < 1:
        raise UsageError("--concurrency must be at least 1")
    if args.n < 1:
        raise UsageError("-n must be at least 1")
    if args.n > 1 and (args.interactive or args.input_file is not None):
        raise UsageError("-n gives several answers to one prompt; it does not go with -i or --input-file")
    if args.interactive:
        with _client_from_args(args) as client:
            return Repl(client, settings, mode=_output_mode(args)).run()
    if args.input_file is not None:
        return _generate_from_file(args, settings)
    prompt = _prompt_from_args(args)
    if not args.quiet:
        kind = "raw prompt" if settings.raw else "chat" + (" with system message" if settings.system else "")
        _err(f"[server={args.server} {kind} {settings.summary()}]\n")
    if args.n > 1 and not args.json:
        return _print_choices(args, settings, prompt)
    with _client_from_args(args) as client:
        last, _text = _stream_answer(
            client,
            settings,
            prompt=prompt if settings.raw else None,
            messages=None if settings.raw else settings.messages((), prompt),
            mode=_output_mode(args),
        )
    if last is not None and not args.quiet and not args.json:
        _err(_stats_line(last))
    return 0


def _print_choices(args: argparse.Namespace, settings: GenSettings, prompt: str) -> int:
    """-n N (text or --show-tokens): each answer whole, under a [choice I] line, in order. (With --json
    the events stream as they come, each with its choice's index.)"""
    with _client_from_args(args) as client:
        results = client.generate_choices(
            prompt if settings.raw else None,
            messages=None if settings.raw else settings.messages((), prompt),
            options=settings.options,
        )
    for index, result in enumerate(results):
        _out(f"[choice {index}]\n")
        if _output_mode(args) == "tokens":
            _out("".join(_token_line(t) for t in result.tokens))
        else:
            _out(result.text if result.text.endswith("\n") else result.text + "\n")
            _out(_tool_call_lines(result.tool_calls))
        if not args.quiet:
            _err(
                _stats_line(
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


@dataclass
class _Outcome:
    result: GenerateResult | None = None
    error: str | None = None
    done: bool = False


def _print_outcome(args: argparse.Namespace, index: int, prompt: str, outcome: _Outcome) -> None:
    if outcome.error is not None:
        _error_line(f"prompt {index + 1}: {outcome.error}")
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
                record["tool_calls"] = [_tool_call_json(c) for c in outcome.result.tool_calls]
        else:
            record["error"] = outcome.error
        _out(json.dumps(record, ensure_ascii=False) + "\n")
    elif outcome.result is not None:
        calls = _tool_call_lines(outcome.result.tool_calls)
        _out(f"Prompt: {prompt}\nCompletion: {outcome.result.text}\n{calls}\n")
    else:
        _out(f"Prompt: {prompt}\nError: {outcome.error}\n\n")


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


def _generate_from_file(args: argparse.Namespace, settings: GenSettings) -> int:
    prompts = _read_prompts(args.input_file)
    if not prompts:
        raise UsageError(f"no prompts in {args.input_file} (one prompt per line; blank lines are skipped)")
    if not args.quiet:
        _err(f"[server={args.server} {len(prompts)} prompts concurrency={args.concurrency} {settings.summary()}]\n")
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
                _err("\r\033[K")  # the bar is redrawn below the output
            _print_outcome(args, printed, prompts[printed], outcomes[printed])
            printed += 1

    with _client_from_args(args) as client:

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
        _err(f"{failed} of {len(prompts)} prompts failed\n")
    return EXIT_FAILED if failed else 0


# ------------------------------------------------------------------------------------------------- REPL

_HELP = """\
Type a message to chat; the conversation is kept until /clear.
  /temp X      sampling temperature (0 = greedy)
  /topk N      keep the N most likely tokens (0 = off)
  /topp P      nucleus sampling, 0 < P <= 1 (1 = off)
  /tokens N    the most tokens per answer (0 = the server's default)
  /seed N      random seed (/seed off for a fresh one each time)
  /system TEXT the system message (/system alone removes it)
  /config      show the settings
  /clear       forget the conversation
  /exit        leave (also quit, exit, Ctrl-D); Ctrl-C stops an answer
  /help        this text
"""


def _parse_float(text: str, name: str, low: float, high: float | None = None) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{name} must be a number, got {text!r}") from None
    if math.isnan(value) or value < low or (high is not None and value > high):
        bounds = f"between {_fmt_num(low)} and {_fmt_num(high)}" if high is not None else f">= {_fmt_num(low)}"
        raise ValueError(f"{name} must be {bounds}, got {text}")
    return value


def _parse_int(text: str, name: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{name} must be a whole number, got {text!r}") from None
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


class Repl:
    """An interactive chat: keeps the user and assistant turns; slash commands change the settings."""

    def __init__(self, client: Client, settings: GenSettings, *, mode: str = "text") -> None:
        self.client = client
        self.settings = settings
        self.mode = mode
        self.history: list[ChatMessage] = []
        self._remember: Callable[[], None] = lambda: None
        self._commands: dict[str, Callable[[str], bool]] = {
            "/temp": self._set_temp,
            "/temperature": self._set_temp,
            "/topk": self._set_topk,
            "/topp": self._set_topp,
            "/tokens": self._set_tokens,
            "/limit": self._set_tokens,
            "/seed": self._set_seed,
            "/system": self._set_system,
            "/config": self._show_config,
            "/clear": self._clear,
            "/help": self._help,
            "/exit": self._exit,
            "/quit": self._exit,
        }

    def run(self) -> int:
        self._remember = _enable_line_editing()
        if self.settings.raw:
            _err("note: --raw is ignored in an interactive session (turns are sent as a chat)\n")
        _err(
            f"tokenmill chat with {self.client.target}: /help for commands, /exit or Ctrl-D to leave, "
            '""" to start and end a message of several lines\n'
        )
        while True:
            try:
                line = input(">>> ")
                if line.lstrip().startswith('"""'):
                    line = self._read_block(line.lstrip()[3:])
            except EOFError:
                _out("\n")
                return 0
            except KeyboardInterrupt:
                _out("\n")  # Ctrl-C at the prompt drops the line, like Python's REPL
                continue
            self._remember()
            line = line.strip()
            if not line:
                continue
            if line in ("quit", "exit"):
                return 0
            if line.startswith("/"):
                if not self._command(line):
                    return 0
                continue
            self._answer(line)

    @staticmethod
    def _read_block(first: str) -> str:
        """A message of several lines, between triple quotes (Ollama's convention)."""
        lines = [first]
        while not lines[-1].rstrip().endswith('"""'):
            lines.append(input("... "))
        lines[-1] = lines[-1].rstrip()[:-3]
        return "\n".join(lines)

    def _command(self, line: str) -> bool:
        """Runs a slash command; False means leave."""
        name, _, arg = line.partition(" ")
        handler = self._commands.get(name.lower())
        if handler is None:
            _error_line(f"unknown command {name} (/help lists the commands)")
            return True
        try:
            return handler(arg.strip())
        except ValueError as exc:
            _error_line(str(exc))
            return True

    def _answer(self, question: str) -> None:
        messages = self.settings.messages(self.history, question)
        try:
            last, answer = _stream_answer(self.client, self.settings, prompt=None, messages=messages, mode=self.mode)
        except KeyboardInterrupt:
            _err("[cancelled]\n")
            return
        except TokenmillError as exc:
            _error_line(describe_error(exc))
            return
        if last is not None and last.finish_reason is FinishReason.LENGTH:
            _err(f"[stopped at the limit of {self.settings.options.max_new_tokens} tokens: /tokens N to change it]\n")
        elif last is not None and last.finish_reason is FinishReason.CONTEXT_LIMIT:
            _err("[the conversation fills the model's context: /clear to start afresh]\n")
        self.history += [ChatMessage("user", question), ChatMessage("assistant", answer)]

    def _set_temp(self, arg: str) -> bool:
        options = self._replace(temperature=_parse_float(arg, "temperature", 0.0))
        _err(f"temperature = {_fmt_num(options.temperature)}\n")
        return True

    def _set_topk(self, arg: str) -> bool:
        options = self._replace(top_k=_parse_int(arg, "top_k"))
        _err(f"top_k = {options.top_k or 'off'}\n")
        return True

    def _set_topp(self, arg: str) -> bool:
        options = self._replace(top_p=_parse_float(arg, "top_p", 0.0, 1.0))
        _err(f"top_p = {_fmt_num(options.top_p)}\n")
        return True

    def _set_tokens(self, arg: str) -> bool:
        options = self._replace(max_new_tokens=_parse_int(arg, "tokens"))
        _err(f"tokens = {options.max_new_tokens or 'server default'}\n")
        return True

    def _set_seed(self, arg: str) -> bool:
        options = self._replace(seed=None if arg.lower() in ("off", "none", "random") else _parse_int(arg, "seed"))
        _err(f"seed = {'random' if options.seed is None else options.seed}\n")
        return True

    def _replace(self, **changes: Unpack[GenerateOverrides]) -> GenerateOptions:
        """The session's options with ``changes`` (the next answers use them)."""
        self.settings.options = dataclasses.replace(self.settings.options, **changes)
        return self.settings.options

    def _set_system(self, arg: str) -> bool:
        self.settings.system = arg or None
        _err("system message set\n" if arg else "system message removed\n")
        return True

    def _show_config(self, arg: str) -> bool:
        o = self.settings.options
        _out(
            f"server      {self.client.target}\n"
            f"temperature {_fmt_num(o.temperature)}\n"
            f"top_k       {o.top_k or 'off'}\n"
            f"top_p       {_fmt_num(o.top_p)}\n"
            f"tokens      {o.max_new_tokens or 'server default'}\n"
            f"seed        {'random' if o.seed is None else o.seed}\n"
            f"stop        {list(o.stop)!r}\n"
            f"system      {self.settings.system!r}\n"
            f"turns       {len(self.history) // 2}\n"
        )
        return True

    def _clear(self, arg: str) -> bool:
        self.history.clear()
        _err("conversation cleared\n")
        return True

    def _help(self, arg: str) -> bool:
        _out(_HELP)
        return True

    def _exit(self, arg: str) -> bool:
        return False


ENV_HISTORY = "TOKENMILL_HISTORY"


def _enable_line_editing() -> Callable[[], None]:
    """Line editing and a history kept across sessions (in $TOKENMILL_HISTORY, else ~/.tokenmill_history),
    where readline exists (not on Windows). Returns what saves the lines entered since the last call."""
    try:
        import readline
    except ImportError:
        return lambda: None
    readline.parse_and_bind("set editing-mode emacs")
    path = os.path.expanduser(os.environ.get(ENV_HISTORY) or "~/.tokenmill_history")
    readline.set_history_length(1000)
    try:
        readline.read_history_file(path)
        readline.write_history_file(path)  # trimmed to the last 1000 lines
    except OSError:
        pass  # a first session: no file yet
    saved = readline.get_current_history_length()

    def remember() -> None:
        # Appended as they are entered, so a session that is killed keeps its lines too.
        nonlocal saved
        new = readline.get_current_history_length() - saved
        if new > 0:
            try:
                if not os.path.exists(path):
                    open(path, "a").close()
                readline.append_history_file(new, path)
                readline.set_history_length(1000)
            except OSError:
                return
            saved += new

    return remember


# ------------------------------------------------------------------------------------ info, tokenize, health


def _format_model_info(info: ModelInfo) -> str:
    lim, eng = info.limits, info.engine
    lines = [
        f"name            {info.name}",
        f"context_length  {info.context_length}",
        f"vocab_size      {info.vocab_size}",
        f"backend         {info.backend}",
        f"device          {info.device}",
        f"dtype           {info.dtype}",
        f"quantization    {info.quantization}",
        f"num_workers     {info.num_workers}",
        (
            f"limits          max_new_tokens={lim.max_new_tokens} max_top_logprobs={lim.max_top_logprobs} "
            f"max_stop_strings={lim.max_stop_strings} max_queue={lim.max_queue} max_batch_size={lim.max_batch_size}"
        ),
        (
            f"engine          running={eng.running} waiting={eng.waiting} "
            f"kv_blocks={eng.kv_blocks_used}/{eng.kv_blocks_total} kv_block_size={eng.kv_block_size}"
        ),
    ]
    lines += [f"plan            {name}: {value}" for name, value in sorted(info.load_plan.items())]
    for w in info.workers:
        lines.append(
            f"worker {w.worker_id:<8} {'alive' if w.alive else 'DEAD'} running={w.running} waiting={w.waiting} "
            f"kv_blocks={w.kv_blocks_used}/{w.kv_blocks_total} restarts={w.restarts}"
        )
    return "\n".join(lines) + "\n"


def cmd_info(args: argparse.Namespace) -> int:
    with _client_from_args(args) as client:
        info = client.model_info()
    _out(_json_line(info) if args.json else _format_model_info(info))
    return 0


def cmd_tokenize(args: argparse.Namespace) -> int:
    with _client_from_args(args) as client:
        tokens = client.tokenize([ChatMessage("user", args.text)] if args.chat else args.text)
    if args.json:
        _out(_json_line({"ids": list(tokens.ids), "pieces": list(tokens.pieces)}))
    else:
        _out(f"ids: {list(tokens.ids)}\npieces: {list(tokens.pieces)!r}\ncount: {len(tokens.ids)}\n")
    return 0


def cmd_health(args: argparse.Namespace) -> int:
    with _client_from_args(args) as client:
        status = client.health(args.service)
    _out(f"{status.value}\n")
    return 0 if status.value == "SERVING" else EXIT_FAILED


# ------------------------------------------------------------------------------------------------ parser


def _connection_options(parser: argparse.ArgumentParser, *, top_level: bool) -> None:
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


def _logit_bias_arg(text: str) -> tuple[int, float]:
    token, sep, bias = text.partition("=")
    try:
        if not sep:
            raise ValueError
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected TOKEN_ID=BIAS, e.g. 42=-100; given {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenmill-client",
        description="Talk to a tokenmill text-generation server.",
    )
    parser.add_argument("--version", action="version", version=f"tokenmill-client {_version()}")
    _connection_options(parser, top_level=True)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    gen = commands.add_parser(
        "generate",
        help="generate text (streamed), chat interactively (-i), or run a file of prompts",
        description="Generate text. By default the prompt is sent as a chat user message; --raw sends it as it is.",
    )
    source = gen.add_mutually_exclusive_group()
    source.add_argument("prompt_arg", nargs="?", metavar="PROMPT", help="the prompt ('-' or none: standard input)")
    source.add_argument("-p", "--prompt", help="the prompt")
    source.add_argument("-i", "--interactive", action="store_true", help="an interactive chat (REPL)")
    source.add_argument("--input-file", metavar="FILE", help="one prompt per line ('-' = stdin), run concurrently")
    gen.add_argument("-t", "--temperature", type=float, default=0.0, help="sampling temperature, 0 = greedy (default)")
    gen.add_argument(
        "-l",
        "--limit",
        "--max-new-tokens",
        type=int,
        default=0,
        metavar="N",
        help="max new tokens (default: 0, the server's default)",
    )
    gen.add_argument("--top-k", type=int, default=0, metavar="K", help="keep the K most likely tokens, 0 = off")
    gen.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling, 1 = off")
    gen.add_argument("--repetition-penalty", type=float, default=1.0, metavar="R", help="1 = off")
    gen.add_argument(
        "--presence-penalty", type=float, default=0.0, metavar="P", help="OpenAI's, in [-2, 2]; 0 = off (default)"
    )
    gen.add_argument(
        "--frequency-penalty", type=float, default=0.0, metavar="F", help="OpenAI's, in [-2, 2]; 0 = off (default)"
    )
    gen.add_argument(
        "--logit-bias",
        type=_logit_bias_arg,
        action="append",
        default=[],
        metavar="ID=BIAS",
        help="add BIAS (in [-100, 100]) to token ID's logit (repeatable; -100 about bans the token)",
    )
    gen.add_argument("--seed", type=int, default=None, help="random seed (same seed, same answer)")
    gen.add_argument(
        "--adapter", default="", metavar="NAME", help="generate with the server's LoRA adapter NAME (default: the base)"
    )
    gen.add_argument(
        "-n", "--choices", dest="n", type=int, default=1, metavar="N", help="N answers to the prompt (default 1)"
    )
    gen.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    gen.add_argument(
        "--ignore-eos", action="store_true", help="keep generating past end-of-sequence, up to the limit (benchmarks)"
    )
    constraint = gen.add_mutually_exclusive_group()
    constraint.add_argument(
        "--json-schema", metavar="FILE", help="the output is JSON valid against the JSON Schema in FILE"
    )
    constraint.add_argument("--json-object", action="store_true", help="the output is one JSON object")
    constraint.add_argument("--regex", metavar="REGEX", help="the whole output matches REGEX")
    constraint.add_argument(
        "--grammar", metavar="FILE", help="the output matches the grammar in FILE (Lark, or GBNF when it uses ::=)"
    )
    gen.add_argument(
        "--tools",
        metavar="FILE",
        help="functions the model may call: a JSON list of OpenAI-style function tools "
        '([{"type": "function", "function": {"name": ..., "description": ..., "parameters": {JSON Schema}}}]); '
        "calls are printed as JSON lines after the answer's text",
    )
    gen.add_argument(
        "--tool-choice",
        metavar="CHOICE",
        help="with --tools: auto (the model decides; default), none, required (the answer is calls), "
        "or a function's name (the answer calls it)",
    )
    gen.add_argument("--no-parallel-tool-calls", action="store_true", help="with --tools: at most one call per answer")
    gen.add_argument("--system", metavar="TEXT", help="system message of the chat")
    gen.add_argument("--raw", action="store_true", help="send the prompt as it is, without the chat template")
    gen.add_argument("--show-tokens", action="store_true", help="print one line per token: repr(text) and logprob")
    gen.add_argument("--json", action="store_true", help="print JSON lines")
    gen.add_argument("--concurrency", type=int, default=8, metavar="N", help="parallel requests for --input-file")
    gen.add_argument("-q", "--quiet", action="store_true", help="no settings summary or statistics on stderr")
    _connection_options(gen, top_level=False)
    gen.set_defaults(func=cmd_generate)

    info = commands.add_parser("info", help="the model, limits and engine state")
    info.add_argument("--json", action="store_true", help="print JSON")
    _connection_options(info, top_level=False)
    info.set_defaults(func=cmd_info)

    tok = commands.add_parser("tokenize", help="token ids and pieces of a text")
    tok.add_argument("text")
    tok.add_argument("--chat", action="store_true", help="tokenize the text as a chat user message")
    tok.add_argument("--json", action="store_true", help="print JSON")
    _connection_options(tok, top_level=False)
    tok.set_defaults(func=cmd_tokenize)

    health = commands.add_parser("health", help="the server's health status (exit code 0 when SERVING)")
    health.add_argument("--service", default="", help="a service name (default: the whole server)")
    _connection_options(health, top_level=False)
    health.set_defaults(func=cmd_health)
    return parser


def _version() -> str:
    from . import __version__

    return __version__


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
        _error_line(str(exc))
        return EXIT_USAGE
    except TokenmillError as exc:
        _error_line(describe_error(exc))
        return EXIT_FAILED
    except KeyboardInterrupt:
        _err("\n")
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (e.g. `| head`): stop quietly, without a second error at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


if __name__ == "__main__":
    raise SystemExit(main())
