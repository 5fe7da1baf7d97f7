"""The generate command's settings: its flags read into GenerateOptions, and how its prompts are sent."""

from __future__ import annotations

import argparse
import json
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .._chat import ChatMessage, FunctionChoice, Tool, ToolChoice
from .._options import GenerateOptions
from .._types import GenerateEvent, GenerateResult
from ..client import Client
from .report import UsageError, fmt_num


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
            f"temperature={fmt_num(o.temperature)}" + (" (greedy)" if o.temperature == 0 else ""),
            f"top_k={o.top_k or 'off'}",
            f"top_p={'off' if o.top_p in (0.0, 1.0) else fmt_num(o.top_p)}",
        ]
        if o.repetition_penalty not in (0.0, 1.0):
            parts.append(f"repetition_penalty={fmt_num(o.repetition_penalty)}")
        if o.presence_penalty:
            parts.append(f"presence_penalty={fmt_num(o.presence_penalty)}")
        if o.frequency_penalty:
            parts.append(f"frequency_penalty={fmt_num(o.frequency_penalty)}")
        if o.logit_bias:
            parts.append("logit_bias=" + ",".join(f"{t}={fmt_num(b)}" for t, b in sorted(o.logit_bias.items())))
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


def output_mode(args: argparse.Namespace) -> str:
    return "json" if args.json else "tokens" if args.show_tokens else "text"


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
        logprobs=output_mode(args) == "tokens",  # --show-tokens prints each token's logprob
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


def settings_from_args(args: argparse.Namespace) -> GenSettings:
    return GenSettings(options=options_from_args(args), system=args.system, raw=args.raw)


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
