"""``generate -i``: an interactive chat that keeps its turns, with slash commands that change the settings."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from .._chat import ChatMessage
from .._options import GenerateOptions, GenerateOverrides
from .._types import FinishReason
from ..client import Client
from ..errors import TokenmillError
from .options import GenSettings
from .report import describe_error, err, error_line, fmt_num, out
from .stream import stream_answer

if TYPE_CHECKING:
    from typing_extensions import Unpack  # annotations only: typing.Unpack needs Python 3.11

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
        bounds = f"between {fmt_num(low)} and {fmt_num(high)}" if high is not None else f">= {fmt_num(low)}"
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


def _shown(o: GenerateOptions) -> dict[str, str]:
    """The settings the slash commands change, as a command's answer and /config show them."""
    return {
        "temperature": fmt_num(o.temperature),
        "top_k": str(o.top_k or "off"),
        "top_p": fmt_num(o.top_p),
        "tokens": str(o.max_new_tokens or "server default"),
        "seed": "random" if o.seed is None else str(o.seed),
    }


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
            err("note: --raw is ignored in an interactive session (turns are sent as a chat)\n")
        err(
            f"tokenmill chat with {self.client.target}: /help for commands, /exit or Ctrl-D to leave, "
            '""" to start and end a message of several lines\n'
        )
        while True:
            try:
                line = input(">>> ")
                if line.lstrip().startswith('"""'):
                    line = self._read_block(line.lstrip()[3:])
            except EOFError:
                out("\n")
                return 0
            except KeyboardInterrupt:
                out("\n")  # Ctrl-C at the prompt drops the line, like Python's REPL
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
            error_line(f"unknown command {name} (/help lists the commands)")
            return True
        try:
            return handler(arg.strip())
        except ValueError as exc:
            error_line(str(exc))
            return True

    def _answer(self, question: str) -> None:
        messages = self.settings.messages(self.history, question)
        try:
            last, answer = stream_answer(self.client, self.settings, prompt=None, messages=messages, mode=self.mode)
        except KeyboardInterrupt:
            err("[cancelled]\n")
            return
        except TokenmillError as exc:
            error_line(describe_error(exc))
            return
        if last is not None and last.finish_reason is FinishReason.LENGTH:
            err(f"[stopped at the limit of {self.settings.options.max_new_tokens} tokens: /tokens N to change it]\n")
        elif last is not None and last.finish_reason is FinishReason.CONTEXT_LIMIT:
            err("[the conversation fills the model's context: /clear to start afresh]\n")
        self.history += [ChatMessage("user", question), ChatMessage("assistant", answer)]

    def _set_temp(self, arg: str) -> bool:
        return self._set("temperature", temperature=_parse_float(arg, "temperature", 0.0))

    def _set_topk(self, arg: str) -> bool:
        return self._set("top_k", top_k=_parse_int(arg, "top_k"))

    def _set_topp(self, arg: str) -> bool:
        return self._set("top_p", top_p=_parse_float(arg, "top_p", 0.0, 1.0))

    def _set_tokens(self, arg: str) -> bool:
        return self._set("tokens", max_new_tokens=_parse_int(arg, "tokens"))

    def _set_seed(self, arg: str) -> bool:
        return self._set("seed", seed=None if arg.lower() in ("off", "none", "random") else _parse_int(arg, "seed"))

    def _set(self, name: str, **changes: Unpack[GenerateOverrides]) -> bool:
        """The session's options with ``changes`` (the next answers use them); says the setting ``name`` now."""
        self.settings.options = dataclasses.replace(self.settings.options, **changes)
        err(f"{name} = {_shown(self.settings.options)[name]}\n")
        return True

    def _set_system(self, arg: str) -> bool:
        self.settings.system = arg or None
        err("system message set\n" if arg else "system message removed\n")
        return True

    def _show_config(self, arg: str) -> bool:
        o = self.settings.options
        rows = {
            "server": self.client.target,
            **_shown(o),
            "stop": repr(list(o.stop)),
            "system": repr(self.settings.system),
            "turns": str(len(self.history) // 2),
        }
        out("".join(f"{name:<11} {value}\n" for name, value in rows.items()))
        return True

    def _clear(self, arg: str) -> bool:
        self.history.clear()
        err("conversation cleared\n")
        return True

    def _help(self, arg: str) -> bool:
        out(_HELP)
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
