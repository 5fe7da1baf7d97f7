"""The command line's parser: the commands, their flags, and the connection flags every command takes."""

from __future__ import annotations

import argparse

from .connect import connection_options
from .generate import cmd_generate
from .info import cmd_health, cmd_info, cmd_tokenize


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenmill-client",
        description="Talk to a tokenmill text-generation server.",
    )
    parser.add_argument("--version", action="version", version=f"tokenmill-client {_version()}")
    connection_options(parser, top_level=True)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_generate(commands)

    info = commands.add_parser("info", help="the model, limits and engine state")
    info.add_argument("--json", action="store_true", help="print JSON")
    connection_options(info, top_level=False)
    info.set_defaults(func=cmd_info)

    tok = commands.add_parser("tokenize", help="token ids and pieces of a text")
    tok.add_argument("text")
    tok.add_argument("--chat", action="store_true", help="tokenize the text as a chat user message")
    tok.add_argument("--json", action="store_true", help="print JSON")
    connection_options(tok, top_level=False)
    tok.set_defaults(func=cmd_tokenize)

    health = commands.add_parser("health", help="the server's health status (exit code 0 when SERVING)")
    health.add_argument("--service", default="", help="a service name (default: the whole server)")
    connection_options(health, top_level=False)
    health.set_defaults(func=cmd_health)
    return parser


def _add_generate(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    gen = commands.add_parser(
        "generate",
        help="generate text (streamed), chat interactively (-i), or run a file of prompts",
        description="Generate text. By default the prompt is sent as a chat user message; --raw sends it as it is.",
    )
    _prompt_flags(gen)
    _sampling_flags(gen)
    _constraint_flags(gen)
    _output_flags(gen)
    connection_options(gen, top_level=False)
    gen.set_defaults(func=cmd_generate)


def _prompt_flags(gen: argparse.ArgumentParser) -> None:
    """Where the prompts come from (one of them)."""
    source = gen.add_mutually_exclusive_group()
    source.add_argument("prompt_arg", nargs="?", metavar="PROMPT", help="the prompt ('-' or none: standard input)")
    source.add_argument("-p", "--prompt", help="the prompt")
    source.add_argument("-i", "--interactive", action="store_true", help="an interactive chat (REPL)")
    source.add_argument("--input-file", metavar="FILE", help="one prompt per line ('-' = stdin), run concurrently")


def _sampling_flags(gen: argparse.ArgumentParser) -> None:
    """Sampling, limits, the adapter and the number of answers."""
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


def _constraint_flags(gen: argparse.ArgumentParser) -> None:
    """Structured output (one constraint at most) and tools."""
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


def _output_flags(gen: argparse.ArgumentParser) -> None:
    """How the prompt is sent and the answer printed."""
    gen.add_argument("--system", metavar="TEXT", help="system message of the chat")
    gen.add_argument("--raw", action="store_true", help="send the prompt as it is, without the chat template")
    gen.add_argument("--show-tokens", action="store_true", help="print one line per token: repr(text) and logprob")
    gen.add_argument("--json", action="store_true", help="print JSON lines")
    gen.add_argument("--concurrency", type=int, default=8, metavar="N", help="parallel requests for --input-file")
    gen.add_argument("-q", "--quiet", action="store_true", help="no settings summary or statistics on stderr")


def _logit_bias_arg(text: str) -> tuple[int, float]:
    token, sep, bias = text.partition("=")
    try:
        if not sep:
            raise ValueError
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected TOKEN_ID=BIAS, e.g. 42=-100; given {text!r}") from None


def _version() -> str:
    from .. import __version__

    return __version__
