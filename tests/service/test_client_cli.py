"""The tokenmill-client command line, run as a real process against a real tokenmill-server.

The interactive session is driven through a real pseudo-terminal (stdlib pty), so readline, Ctrl-C
and Ctrl-D behave as they do for a person at a terminal.
"""

from __future__ import annotations

import ast
import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.server_process import free_port
from tests.service.test_client_api import scripted_server
from tokenmill_client import ChatMessage, Client, GenerateOptions, InvalidRequestError
from tokenmill_client._convert import build_generate_request
from tokenmill_client.cli import build_parser, main, options_from_args

CLIENT = Path(sys.executable).parent / "tokenmill-client"
QUESTION = "What is the capital of France?"


def client_cmd(*args: str) -> list[str]:
    """The installed console script when there is one, else the same main() through -m."""
    if CLIENT.exists():
        return [str(CLIENT), *args]
    return [sys.executable, "-m", "tokenmill_client", *args]


def run_cli(*args: str, timeout: float = 300, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TOKENMILL_SERVER", "TOKENMILL_TOKEN")}
    return subprocess.run(
        client_cmd(*args), capture_output=True, text=True, timeout=timeout, input=stdin, env=env, check=False
    )


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


# --------------------------------------------------------------------------------- no server needed


def test_help_lists_the_commands() -> None:
    proc = run_cli("--help")
    assert proc.returncode == 0
    for command in ("generate", "info", "tokenize", "health", "--server"):
        assert command in proc.stdout


def test_unreachable_server_exits_nonzero_with_one_error_line_naming_the_address() -> None:
    address = f"127.0.0.1:{free_port()}"
    for args in (
        ("--server", address, "generate", "-p", QUESTION),
        ("generate", "--server", address, "-p", QUESTION),
        ("--server", address, "info"),
        ("--server", address, "health"),
        ("--server", address, "tokenize", "hello"),
    ):
        proc = run_cli(*args, "--max-retries", "1")
        assert proc.returncode == 1, args
        errors = error_lines(proc.stderr)
        assert len(errors) == 1, proc.stderr
        assert address in errors[0]
        assert "Traceback" not in proc.stderr
        assert proc.stdout == ""


def test_missing_prompt_is_one_error_line_and_exit_code_2() -> None:
    proc = run_cli("--server", f"127.0.0.1:{free_port()}", "generate")
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [error_lines(proc.stderr)[0]]
    assert "missing prompt" in proc.stderr


def test_system_message_with_raw_prompt_is_a_usage_error() -> None:
    proc = run_cli("generate", "-p", "hi", "--raw", "--system", "Be brief.")
    assert proc.returncode == 2
    assert len(error_lines(proc.stderr)) == 1


def test_unreadable_input_file_is_a_usage_error(tmp_path: Path) -> None:
    proc = run_cli("generate", "--input-file", str(tmp_path / "missing.txt"))
    assert proc.returncode == 2
    assert "missing.txt" in error_lines(proc.stderr)[0]


def test_generate_flags_map_to_one_generate_options() -> None:
    parser = build_parser()
    # No flags: the type's own defaults.
    assert options_from_args(parser.parse_args(["generate", "hi"])) == GenerateOptions()
    args = parser.parse_args(
        ["generate", "hi", "-t", "0.7", "-l", "12", "--top-k", "5", "--top-p", "0.9", "--repetition-penalty", "1.2",
         "--seed", "3", "--stop", "END", "--stop", "\n\n", "--ignore-eos", "--show-tokens", "--timeout", "30"]
    )  # fmt: skip
    assert options_from_args(args) == GenerateOptions(
        max_new_tokens=12,
        temperature=0.7,
        top_k=5,
        top_p=0.9,
        repetition_penalty=1.2,
        seed=3,
        stop=("END", "\n\n"),
        ignore_eos=True,
        logprobs=True,  # what --show-tokens prints
    )  # --timeout stays the client's default deadline, for every command
    assert not options_from_args(parser.parse_args(["generate", "hi", "--show-tokens", "--json"])).logprobs
    penalized = parser.parse_args(
        ["generate", "hi", "--presence-penalty", "0.5", "--frequency-penalty", "-1", "--logit-bias", "42=-100",
         "--logit-bias", "7=2.5"]
    )  # fmt: skip
    assert options_from_args(penalized) == GenerateOptions(
        presence_penalty=0.5, frequency_penalty=-1.0, logit_bias={42: -100.0, 7: 2.5}
    )


def test_a_malformed_logit_bias_is_a_usage_error() -> None:
    proc = run_cli("generate", "hi", "--logit-bias", "42")
    assert proc.returncode == 2 and "TOKEN_ID=BIAS" in proc.stderr


def test_generate_sends_the_options_its_flags_make(capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["-t", "0.5", "-l", "7", "--top-k", "3", "--seed", "9", "--stop", "END", "--ignore-eos"]
    with scripted_server(["ok"]) as (address, servicer):
        assert main(["--server", address, "generate", "hi", "-q", *flags]) == 0
        assert main(["--server", address, "generate", "hi", "-q", "--raw", "--system", "x"]) == 2  # never sent
        assert main(["--server", address, "generate", "hi", "-q", "--raw", "--show-tokens"]) == 0
    options = GenerateOptions(temperature=0.5, max_new_tokens=7, top_k=3, seed=9, stop="END", ignore_eos=True)
    assert servicer.requests == [
        build_generate_request(None, [ChatMessage("user", "hi")], None, options),
        build_generate_request("hi", None, None, GenerateOptions(logprobs=True)),
    ]
    assert capsys.readouterr().out == "Hello!\n'Hello'\t-\n'!'\t-\n"


# ------------------------------------------------------------------------------------- live server


def test_generate_streams_an_answer_containing_paris(server_address: str) -> None:
    proc = run_cli("--server", server_address, "generate", "-p", QUESTION, "-l", "32")
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    assert "temperature" in proc.stderr  # the settings summary goes to stderr, not stdout
    assert "temperature" not in proc.stdout


def test_raw_prompt_and_system_message_are_accepted(server_address: str) -> None:
    raw = run_cli("generate", "--server", server_address, "-p", "The capital of France is", "--raw", "-l", "4")
    assert raw.returncode == 0, raw.stderr
    assert raw.stdout.strip()
    system = run_cli("generate", "--server", server_address, "-p", QUESTION, "--system", "Answer briefly.", "-l", "16")
    assert system.returncode == 0, system.stderr
    assert system.stdout.strip()


def test_show_tokens_prints_one_line_per_token_with_its_repr_and_logprob(server_address: str) -> None:
    proc = run_cli("--server", server_address, "generate", "-p", QUESTION, "--show-tokens", "-l", "8")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert 1 <= len(lines) <= 8
    texts = []
    for line in lines:
        text_repr, logprob = line.split("\t")
        texts.append(ast.literal_eval(text_repr))
        assert isinstance(texts[-1], str)
        assert float(logprob) <= 0.0
    assert "Paris" in "".join(texts)


def test_json_prints_one_event_per_line_ending_with_the_finish_reason(server_address: str) -> None:
    proc = run_cli("--server", server_address, "generate", "-p", QUESTION, "--json", "-l", "8")
    assert proc.returncode == 0, proc.stderr
    events = [json.loads(line) for line in proc.stdout.splitlines()]
    assert events[-1]["finish_reason"] in ("eos", "length")
    assert events[-1]["usage"]["completion_tokens"] == sum(len(e["tokens"]) for e in events)
    assert all(e["finish_reason"] is None for e in events[:-1])


def test_ignore_eos_generates_up_to_the_limit(server_address: str) -> None:
    def last_event(*flags: str) -> dict[str, Any]:
        proc = run_cli("--server", server_address, "generate", "-p", QUESTION, "--json", "-l", "64", *flags)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout.splitlines()[-1])

    short = last_event()  # the answer ends well before 64 tokens
    assert short["finish_reason"] == "eos" and short["usage"]["completion_tokens"] < 64
    full = last_event("--ignore-eos")
    assert full["finish_reason"] == "length" and full["usage"]["completion_tokens"] == 64


def test_penalty_and_logit_bias_flags_give_what_the_client_gives_with_the_same_options(server_address: str) -> None:
    prompt = "The capital of France is"
    with Client(server_address) as client:
        first = client.generate_text(prompt, max_new_tokens=1).tokens[0].id
        options = GenerateOptions(
            max_new_tokens=6, ignore_eos=True, logit_bias={first: -100}, presence_penalty=1.5, frequency_penalty=0.5
        )
        expected = client.generate_text(prompt, options=options)
    assert first not in [t.id for t in expected.tokens]
    proc = run_cli(
        "--server", server_address, "generate", "-p", prompt, "--raw", "-l", "6", "--ignore-eos", "--json",
        "--logit-bias", f"{first}=-100", "--presence-penalty", "1.5", "--frequency-penalty", "0.5",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    events = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [t["id"] for e in events for t in e["tokens"]] == [t.id for t in expected.tokens]


def test_n_prints_each_choice_under_its_index_as_generate_choices_gives_them(server_address: str) -> None:
    prompt = "The best thing about the weekend is"
    options = GenerateOptions(max_new_tokens=6, temperature=1.0, seed=3, n=2)
    with Client(server_address) as client:
        expected = client.generate_choices(prompt, options=options)
    assert len(expected) == 2 and expected[0].text != expected[1].text
    proc = run_cli(
        "--server", server_address, "generate", "-p", prompt, "--raw", "-l", "6", "-t", "1", "--seed", "3", "-n", "2"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "".join(f"[choice {i}]\n{r.text}\n" for i, r in enumerate(expected))
    assert proc.stderr.count("[finish=") == 2


def test_an_invalid_value_is_named_by_the_flag_that_set_it(server_address: str) -> None:
    with Client(server_address) as client, pytest.raises(InvalidRequestError) as info:
        client.generate_text(QUESTION, max_new_tokens=5000)
    assert "max_new_tokens must be <= 4096" in info.value.message  # the gRPC field, for the client's caller
    for flag in ("-l", "--max-new-tokens"):
        proc = run_cli("--server", server_address, "generate", "-p", QUESTION, flag, "5000")
        assert proc.returncode == 1
        (line,) = error_lines(proc.stderr)
        assert "--max-new-tokens must be <= 4096" in line and "stopping." not in line, line
    proc = run_cli("--server", server_address, "generate", "-p", QUESTION, "--presence-penalty", "3")
    (line,) = error_lines(proc.stderr)
    assert "--presence-penalty must be in [-2, 2]" in line, line


def test_invalid_argument_shows_the_servers_message_and_exits_nonzero(server_address: str) -> None:
    with Client(server_address) as client, pytest.raises(InvalidRequestError) as info:
        client.generate_text(messages=[("user", QUESTION)], top_p=2.0)
    proc = run_cli("--server", server_address, "generate", "-p", QUESTION, "--top-p", "2")
    assert proc.returncode == 1
    errors = error_lines(proc.stderr)
    assert len(errors) == 1
    assert info.value.message.replace("sampling.top_p", "--top-p") in errors[0]
    assert "Traceback" not in proc.stderr


def test_info_tokenize_and_health_commands(server_address: str) -> None:
    info = run_cli("info", "--server", server_address)
    assert info.returncode == 0, info.stderr
    assert re.search(r"^context_length\s+\d+$", info.stdout, re.MULTILINE)
    assert re.search(r"^plan\s+executor: native-stack \(", info.stdout, re.MULTILINE)
    info_json = json.loads(run_cli("info", "--server", server_address, "--json").stdout)
    assert info_json["num_workers"] == len(info_json["workers"])
    assert info_json["load_plan"]["kv_cache_layout"] == "blocks, keys transposed per block"

    tok = run_cli("tokenize", "--server", server_address, "Hello world", "--json")
    assert tok.returncode == 0, tok.stderr
    data = json.loads(tok.stdout)
    assert len(data["ids"]) == len(data["pieces"]) >= 2
    assert "".join(data["pieces"]) == "Hello world"

    health = run_cli("health", "--server", server_address)
    assert health.returncode == 0
    assert health.stdout.strip() == "SERVING"


def test_input_file_gives_every_completion_in_input_order(server_address: str, tmp_path: Path) -> None:
    prompts = [f"What is {i} plus {i}?" for i in range(1, 21)]
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(p + ("\n" if i % 5 == 0 else "") for i, p in enumerate(prompts)) + "\n\n")
    proc = run_cli("--server", server_address, "generate", "--input-file", str(path), "-l", "8", "--concurrency", "8")
    assert proc.returncode == 0, proc.stderr
    assert re.findall(r"^Prompt: (.*)$", proc.stdout, re.MULTILINE) == prompts
    assert len(re.findall(r"^Completion: ", proc.stdout, re.MULTILINE)) == 20
    assert "20/20" not in proc.stderr  # no progress bar when stderr is not a terminal

    as_json = run_cli("--server", server_address, "generate", "--input-file", str(path), "-l", "4", "--json", "--raw")
    assert as_json.returncode == 0, as_json.stderr
    records = [json.loads(line) for line in as_json.stdout.splitlines()]
    assert [r["prompt"] for r in records] == prompts
    assert [r["index"] for r in records] == list(range(20))
    assert all(r["finish_reason"] in ("eos", "length") for r in records)


def test_input_file_reports_a_failed_prompt_and_finishes_the_rest(server_address: str, tmp_path: Path) -> None:
    with Client(server_address) as client:
        context = client.model_info().context_length
    too_long = "hello " * (context + 64)
    path = tmp_path / "prompts.txt"
    path.write_text(f"{QUESTION}\n{too_long}\nSay hi.\n")
    proc = run_cli("--server", server_address, "generate", "--input-file", str(path), "-l", "8")
    assert proc.returncode == 1
    blocks = proc.stdout.strip().split("\n\n")
    assert len(blocks) == 3
    assert blocks[0].startswith(f"Prompt: {QUESTION}\nCompletion: ")
    assert "\nError: " in blocks[1]
    assert blocks[2].startswith("Prompt: Say hi.\nCompletion: ")
    errors = error_lines(proc.stderr)
    assert len(errors) == 1 and "prompt 2" in errors[0]
    assert "Traceback" not in proc.stderr


# ------------------------------------------------------------------------------------------------- REPL


class PtySession:
    """A process whose stdin, stdout and stderr are a pseudo-terminal that it has as controlling terminal."""

    def __init__(self, argv: list[str], history: Path | None = None) -> None:
        master, slave = os.openpty()
        env = {k: v for k, v in os.environ.items() if k not in ("TOKENMILL_SERVER", "TOKENMILL_TOKEN")}
        env.update(TERM="dumb", PYTHONUNBUFFERED="1")
        if history is not None:  # the REPL's history file, never the user's own
            env["TOKENMILL_HISTORY"] = str(history)
        # A new session whose controlling terminal is the pty, so Ctrl-C (0x03) sends it SIGINT, with
        # SIGINT's default action as in a user's terminal: a suite started in the background by a
        # shell without job control inherits SIGINT ignored, and exec keeps it ignored. Done by a tiny
        # exec wrapper rather than preexec_fn, which is unsafe in a threaded parent.
        wrapper = (
            "import fcntl, os, signal, sys, termios; fcntl.ioctl(0, termios.TIOCSCTTY, 0); "
            "signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])"
        )
        self.proc = subprocess.Popen(
            [sys.executable, "-c", wrapper, *argv],
            stdin=slave,
            stdout=slave,
            stderr=slave,
            start_new_session=True,
            env=env,
        )
        os.close(slave)
        self.master = master
        self.output = ""
        self.pos = 0

    def _read(self, timeout: float) -> bool:
        ready, _, _ = select.select([self.master], [], [], timeout)
        if not ready:
            return True
        try:
            data = os.read(self.master, 65536)
        except OSError:  # EIO: the child closed the terminal
            return False
        if not data:
            return False
        self.output += data.decode("utf-8", errors="replace").replace("\r\n", "\n")
        return True

    def expect(self, pattern: str, timeout: float = 120.0) -> re.Match[str]:
        """Waits for ``pattern`` (a regex) in the output after the previous match."""
        regex = re.compile(pattern, re.MULTILINE)
        deadline = time.monotonic() + timeout
        while True:
            match = regex.search(self.output, self.pos)
            if match:
                self.pos = match.end()
                return match
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._read(min(remaining, 0.5)):
                match = regex.search(self.output, self.pos)
                if match:
                    self.pos = match.end()
                    return match
                raise AssertionError(f"{pattern!r} not seen; output after the last match:\n{self.output[self.pos :]}")

    def send(self, text: str) -> None:
        os.write(self.master, text.encode())

    def wait(self, timeout: float = 30.0) -> int:
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            self._read(0.1)
        return self.proc.wait(timeout=1)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        os.close(self.master)


PROMPT = r"^>>> "


@pytest.fixture
def repl(server_address: str, tmp_path: Path) -> Iterator[PtySession]:
    session = PtySession(client_cmd("--server", server_address, "generate", "-i", "-l", "24"), tmp_path / "history")
    session.expect(PROMPT, timeout=60)
    yield session
    session.close()


def test_repl_changes_settings_answers_keeps_the_conversation_and_exits(repl: PtySession) -> None:
    repl.send("/temp 0.7\n")
    repl.expect(r"temperature = 0\.7")
    repl.expect(PROMPT)
    repl.send("/seed 11\n")
    repl.expect(PROMPT)
    repl.send("/config\n")
    repl.expect(r"^temperature\s+0\.7$")
    repl.expect(r"^seed\s+11$")
    repl.expect(r"^turns\s+0$")
    repl.expect(PROMPT)

    repl.send(QUESTION + "\n")
    start = repl.pos
    after = repl.expect(PROMPT, timeout=180)
    answer = repl.output[start : after.start()].replace(QUESTION, "", 1)  # less the echoed question
    assert answer.strip()
    repl.send("/config\n")
    repl.expect(r"^turns\s+1$")
    repl.expect(PROMPT)

    repl.send("/clear\n")
    repl.expect("conversation cleared")
    repl.expect(PROMPT)
    repl.send("/config\n")
    repl.expect(r"^turns\s+0$")
    repl.expect(PROMPT)

    repl.send("/exit\n")
    assert repl.wait() == 0


def test_repl_unknown_command_and_bad_values_print_an_error_and_go_on(repl: PtySession) -> None:
    repl.send("/frobnicate\n")
    repl.expect(r"error: unknown command /frobnicate")
    repl.expect(PROMPT)
    repl.send("/temp warm\n")
    repl.expect(r"error: temperature must be a number")
    repl.expect(PROMPT)
    repl.send("/topp 1.5\n")
    repl.expect(r"error: top_p must be between 0 and 1")
    repl.expect(PROMPT)
    repl.send("/help\n")
    repl.expect(r"/clear")
    repl.expect(PROMPT)
    repl.send("/config\n")
    repl.expect(r"^temperature\s+0$")  # the bad values changed nothing
    repl.expect(r"^top_p\s+1$")
    repl.expect(PROMPT)
    assert repl.proc.poll() is None
    repl.send("quit\n")
    assert repl.wait() == 0


def test_repl_ctrl_c_cancels_the_answer_not_the_session_and_ctrl_d_leaves(
    repl: PtySession, server_address: str
) -> None:
    repl.send("/tokens 2000\n")
    repl.expect(PROMPT)
    repl.send("Write a very long story about a dragon who learns to cook.\n")
    repl.expect(r"cook\.\n\s*\S")  # the echo, then the first piece of the answer
    repl.send("\x03")
    repl.expect(r"\[cancelled\]")
    repl.expect(PROMPT)
    with Client(server_address) as client:  # the server stopped generating
        for _ in range(100):
            engine = client.model_info().engine
            if engine.running == 0 and engine.waiting == 0:
                break
            time.sleep(0.1)
        assert engine.running == 0 and engine.waiting == 0
    repl.send("/config\n")
    repl.expect(r"^turns\s+0$")  # the cancelled turn is not kept
    repl.expect(PROMPT)
    repl.send("\x04")
    assert repl.wait() == 0


def test_repl_history_is_kept_across_sessions_and_triple_quotes_span_lines(server_address: str, tmp_path: Path) -> None:
    history = tmp_path / "history"
    first = PtySession(client_cmd("--server", server_address, "generate", "-i", "-l", "8"), history)
    try:
        first.expect(PROMPT, timeout=60)
        first.send("/seed 42\n")
        first.expect("seed = 42")
        first.expect(PROMPT)
        first.send('"""Answer in one word.\n')
        first.expect(r"^\.\.\. ")  # a continuation prompt
        first.send('What is the capital of France?"""\n')
        first.expect(PROMPT, timeout=180)
        first.send("/config\n")
        first.expect(r"^turns\s+1$")  # the two lines were one message
        first.expect(PROMPT)
        first.send("/exit\n")
        assert first.wait() == 0
    finally:
        first.close()
    assert "/seed 42" in history.read_text()

    second = PtySession(client_cmd("--server", server_address, "generate", "-i"), history)
    try:
        second.expect(PROMPT, timeout=60)
        # Ctrl-P: back through the history (/exit, /config, the two quoted lines) to "/seed 42".
        second.send("\x10" * 5)
        second.send("\n")
        second.expect("seed = 42")
        second.expect(PROMPT)  # a Ctrl-D sent before the next prompt reads its input raced with it (seen under load)
        second.send("\x04")
        assert second.wait() == 0
    finally:
        second.close()


# ------------------------------------------------------------------------------------- rough edges


def run_server_cli(*args: str) -> subprocess.CompletedProcess[str]:
    server = Path(sys.executable).parent / "tokenmill-server"
    return subprocess.run([str(server), *args], capture_output=True, text=True, timeout=60, check=False)


def test_version_flags() -> None:
    client = run_cli("--version")
    assert client.returncode == 0 and re.fullmatch(r"tokenmill-client \S+\n", client.stdout)
    server = run_server_cli("--version")
    assert server.returncode == 0 and re.fullmatch(r"tokenmill-server \S+\n", server.stdout)


def test_server_help_shows_the_defaults() -> None:
    proc = run_server_cli("--help")
    text = " ".join(proc.stdout.split())
    for default in ("default: 50051", "default: 8000", "default: 1024", "default: 4096", "default: 256"):
        assert default in text


def test_an_unknown_flag_prints_the_commands_usage() -> None:
    proc = run_cli("generate", "--no-such-flag", "hi")
    assert proc.returncode == 2
    assert proc.stderr.startswith("usage: tokenmill-client generate ")
    assert "unrecognized arguments: --no-such-flag" in proc.stderr


def test_an_empty_prompt_is_a_usage_error() -> None:
    for args, stdin in ((("generate", "  "), None), (("generate", "-p", ""), None), (("generate",), " \n")):
        proc = run_cli("--server", f"127.0.0.1:{free_port()}", *args, stdin=stdin)
        assert proc.returncode == 2, args
        assert error_lines(proc.stderr) == ["error: the prompt is empty"], proc.stderr


def test_the_prompt_can_be_an_argument_or_standard_input(server_address: str) -> None:
    positional = run_cli("--server", server_address, "generate", QUESTION, "-l", "8", "-q")
    assert positional.returncode == 0, positional.stderr
    assert "Paris" in positional.stdout and positional.stderr == ""
    piped = run_cli("--server", server_address, "generate", "-l", "8", "-q", stdin=QUESTION + "\n")
    assert piped.returncode == 0, piped.stderr
    assert piped.stdout == positional.stdout


def test_the_example_prompts_file_runs_as_the_readme_shows(server_address: str) -> None:
    path = Path(__file__).resolve().parents[2] / "client" / "examples" / "prompts.txt"
    prompts = [line for line in path.read_text().splitlines() if line.strip()]
    assert len(prompts) >= 4
    proc = run_cli("--server", server_address, "generate", "--input-file", str(path), "-l", "2", "--json", "-q")
    assert proc.returncode == 0, proc.stderr
    assert [json.loads(line)["prompt"] for line in proc.stdout.splitlines()] == prompts


def test_json_batch_output_streams_in_input_order_before_the_batch_ends(server_address: str, tmp_path: Path) -> None:
    path = tmp_path / "prompts.txt"
    path.write_text("".join(f"Say the number {i}.\n" for i in range(4)))
    proc = subprocess.Popen(
        client_cmd("--server", server_address, "generate", "--input-file", str(path), "-l", "6", "--json")
        + ["--concurrency", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    first = json.loads(proc.stdout.readline())
    assert first["index"] == 0 and proc.poll() is None  # printed while the others still run
    rest = [json.loads(line) for line in proc.stdout]
    assert proc.wait(300) == 0
    assert [r["index"] for r in rest] == [1, 2, 3]


def test_the_progress_bar_shows_on_a_terminal_but_not_with_quiet(server_address: str, tmp_path: Path) -> None:
    path = tmp_path / "prompts.txt"
    path.write_text("Hi.\nHello.\n")
    for quiet in (False, True):
        session = PtySession(
            client_cmd("--server", server_address, "generate", "--input-file", str(path), "-l", "2")
            + (["-q"] if quiet else [])
        )
        try:
            assert session.wait(300) == 0
            assert ("2/2" in session.output) is not quiet, session.output
        finally:
            session.close()


def test_constraint_flags_and_options_shape_the_answer(server_address: str, tmp_path: Path) -> None:
    schema = {
        "type": "object",
        "properties": {"capital": {"type": "string", "maxLength": 20}},
        "required": ["capital"],
        "additionalProperties": False,
    }
    with Client(server_address) as client:
        text = client.generate_text(messages=[("user", QUESTION)], json_schema=schema, max_new_tokens=20).text
        assert set(json.loads(text)) == {"capital"}
        with pytest.raises(ValueError, match="at most one of"):
            client.generate_text(QUESTION, regex="a", json_object=True)
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(schema))
    proc = run_cli(
        "--server", server_address, "generate", "-q", "-p", QUESTION, "-l", "20", "--json-schema", str(schema_file)
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == json.loads(text)
    proc = run_cli("--server", server_address, "generate", "-q", "-p", QUESTION, "-l", "8", "--regex", "[A-Z][a-z]+")
    assert proc.returncode == 0 and re.fullmatch(r"[A-Z][a-z]+\n?", proc.stdout), proc.stdout
    grammar = tmp_path / "answer.gbnf"
    grammar.write_text('root ::= "yes" | "no"')
    proc = run_cli("--server", server_address, "generate", "-q", "-p", QUESTION, "-l", "4", "--grammar", str(grammar))
    assert proc.returncode == 0 and proc.stdout.strip() in ("yes", "no"), proc.stdout
    proc = run_cli("--server", server_address, "generate", "-q", "-p", QUESTION, "--regex", "(")
    (line,) = error_lines(proc.stderr)
    assert "--regex: the regex cannot be used" in line, line
