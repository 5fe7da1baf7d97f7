"""What a newcomer meets first: `make run`'s output, and type-checking their own code against `make install`."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server_process import free_port
from tests.service.test_client_cli import PtySession
from tests.service.test_client_light_install import _NOT_BUILD_INPUTS

REPO = Path(__file__).resolve().parents[2]
STAMP, LINKED = ".venv/.installed", ".venv/.linked"


def test_make_install_keeps_pip_quiet() -> None:
    dry = subprocess.run(
        ["make", "-C", str(REPO), "-n", "-B", "install"], capture_output=True, text=True, timeout=60, check=True
    )
    installs = [line for line in dry.stdout.splitlines() if "pip " in line and " install " in line]
    assert installs
    for line in installs:
        assert "-qq" in line and "--disable-pip-version-check" in line, line
    assert any("editable_mode=strict" in line for line in installs)


# A stand-in for python3 and the venv's python: prints each pip run on stdout (so its place among make's own
# lines shows), makes the venv it is asked for, and has no torch.
STAND_IN_PYTHON = """#!/bin/sh
case "$1 $2" in
  "-m venv") mkdir -p "$3/bin" && cp "$0" "$3/bin/python" ;;
  "-m pip") echo "ran: pip $*" ;;
  "-c import torch") exit 1 ;;
esac
exit 0
"""


def test_a_first_make_install_says_what_each_step_installs_before_it_runs(tmp_path: Path) -> None:
    """A fresh clone's `make run` spends minutes in pip, which is quiet: a line before each step says what is
    being installed, so the output (a terminal or not) is never silent for minutes."""
    python = tmp_path / "python3"
    python.write_text(STAND_IN_PYTHON)
    python.chmod(0o755)
    venv = tmp_path / "venv"
    make = ["make", "--no-print-directory", "-C", str(REPO), "install", f"VENV={venv}", f"PYTHON={python}"]
    done = subprocess.run(make, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert "a few minutes" in lines[0], lines
    steps = [line for line in lines if line.startswith("make: [")]
    assert [step.split("]")[0] for step in steps] == [f"make: [{i}/5" for i in range(1, 6)], lines
    assert "torch" in steps[2] and "minutes" in steps[2] and "SmolLM2" in steps[4], steps
    pips = [i for i, line in enumerate(lines) if line.startswith("ran: pip")]
    assert len(pips) == 5, lines  # pip itself, torch, tokenmill, the model, and the link of the sources
    for i in pips:
        assert lines[i - 1].startswith("make: "), (lines[i - 1], lines[i])


def test_make_run_without_a_compiler_says_what_to_install_and_still_starts(tmp_path: Path) -> None:
    """No C++ compiler on PATH: `make run` says, before the server starts, what the native kernels'
    absence costs and what to install, then starts it all the same (a stand-in server here, which prints
    its flags; tests/service/test_without_native_kernels.py serves from the real one without a compiler)."""
    server = tmp_path / "tokenmill-server"
    server.write_text('#!/bin/sh\necho "server started: $*"\n')
    server.chmod(0o755)
    make = ["make", "-C", str(REPO), "-o", STAMP, "-o", LINKED, "run", f"BIN={tmp_path}"]
    missing = subprocess.run([*make, "CXX=/nonexistent/g++"], capture_output=True, text=True, timeout=60, check=False)
    assert missing.returncode == 0, missing.stderr
    assert "make: no C++ compiler (/nonexistent/g++) on PATH" in missing.stderr
    assert "apt-get install g++" in missing.stderr and "slower" in missing.stderr
    assert "server started: --host 127.0.0.1" in missing.stdout
    present = subprocess.run([*make, f"CXX={sys.executable}"], capture_output=True, text=True, timeout=60, check=False)
    assert present.returncode == 0 and "compiler" not in present.stderr
    assert "server started" in present.stdout


@pytest.fixture(scope="module")
def make_run() -> Iterator[tuple[PtySession, int, int]]:
    """`make run` on free ports, as a person starts it (with the install step counted as done: `make test`
    has just run it). TOKENMILL_DEFAULT_MAX_NEW_TOKENS=48 keeps the answers of the commands that set
    no limit short; nothing else differs from a plain `make run`."""
    port, http_port = free_port(), free_port()
    make = shutil.which("make") or "make"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TOKENMILL_DEFAULT_MAX_NEW_TOKENS", "48")
        session = PtySession(
            [make, "-C", str(REPO), "-o", STAMP, "-o", LINKED, "run", f"PORT={port}", f"HTTP_PORT={http_port}"]
        )
    try:
        session.expect(r"tokenmill is ready: ", timeout=400)
        yield session, port, http_port
        session.send("\x03")  # Ctrl-C: the server drains and stops
        session.expect("server_stopped", timeout=120)
    finally:
        if session.proc.poll() is None:
            os.killpg(session.proc.pid, signal.SIGTERM)
        session.close()


@pytest.mark.timeout(300)
def test_make_run_prints_the_banner_and_other_ports_when_its_output_is_not_a_terminal(tmp_path: Path) -> None:
    """Written to a file (an IDE's console, CI, `| tee`), `make run` still says how to call the server, on the
    ports it was given, and how to choose others."""
    port, http_port = free_port(), free_port()
    make = shutil.which("make") or "make"
    argv = [make, "-C", str(REPO), "-o", STAMP, "-o", LINKED, "run", f"PORT={port}", f"HTTP_PORT={http_port}"]
    log = tmp_path / "make-run.log"
    with log.open("w") as out:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while "Ctrl-C stops the server." not in log.read_text() and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.2)
        output = log.read_text()
        assert "tokenmill is ready: " in output, output[-3000:]
        assert "generate -l 32 " in output and f"127.0.0.1:{port} tokenmill.v1.Generation/Generate" in output
        assert f"curl -N http://127.0.0.1:{http_port}/v1/chat/completions" in output
        assert "make run PORT=" in output and "HTTP_PORT=" in output
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # make and the server: it drains (nothing in flight) and stops
        proc.wait(120)


def run_as_pasted(command: str, port: int, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """A shell command run from the repository's root, the CLI pointed at the test's server."""
    env = {k: v for k, v in os.environ.items() if k != "TOKENMILL_TOKEN"}
    env["TOKENMILL_SERVER"] = f"localhost:{port}"
    return subprocess.run(
        ["bash", "-c", command], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


@pytest.mark.timeout(600)
def test_make_run_prints_one_copy_pasteable_banner_with_the_real_paths(make_run: tuple[PtySession, int, int]) -> None:
    session, port, http_port = make_run
    block = session.expect(r"(?s)\n\n(.*?)\n\nCtrl-C stops the server\.", timeout=30).group(1)
    commands = [line.strip() for line in block.splitlines() if not line.strip().startswith("(")]
    assert len(commands) == 4
    assert "pip" not in session.output.lower()
    client = shlex.split(commands[0])
    exe = Path(client[0]) if Path(client[0]).is_absolute() else REPO / client[0]
    assert exe.name == "tokenmill-client" and os.access(exe, os.X_OK)
    assert commands[2].split()[0] in (".tools/bin/grpcurl", "grpcurl")
    assert commands[3].startswith(f"curl -N http://127.0.0.1:{http_port}/v1/chat/completions")
    # Each example asks for a few tokens, and works as pasted from the repository's root.
    assert "-l 32" in commands[0] and '"max_new_tokens": 16' in commands[2] and '"max_tokens": 32' in commands[3]
    answer = run_as_pasted(commands[0], port)
    assert answer.returncode == 0 and "Paris" in answer.stdout, answer.stderr
    for command in commands[2:]:
        if command.startswith("grpcurl") and shutil.which("grpcurl") is None:
            continue  # the banner says how to get it
        pasted = run_as_pasted(command, port)
        assert pasted.returncode == 0 and pasted.stdout.strip(), (command, pasted.stderr)


def readme_block(after: str, language: str) -> str:
    """The first ```language block of the README after the line containing `after`."""
    readme = (REPO / "README.md").read_text()
    start = readme.index(after)
    match = re.search(rf"```{language}\n(.*?)```", readme[start:], re.DOTALL)
    assert match, f"no {language} block after {after!r}"
    return match.group(1)


@pytest.mark.timeout(600)
def test_the_readme_quickstart_runs_line_by_line(make_run: tuple[PtySession, int, int]) -> None:
    """The README's quick start against `make run`'s server: the shell lines (but the interactive one),
    the Python snippets, and the curl line, so that the README and the code cannot drift apart. They
    run side by side, as several people would; the server batches them."""
    _, port, http_port = make_run
    lines = readme_block("From another terminal", "sh").replace("\\\n", "").splitlines()
    assert len(lines) >= 8
    # Only the client's commands: nothing here may install or start anything.
    assert all(line.startswith((".venv/bin/tokenmill-client", "echo ", ".tools/bin/grpcurl")) for line in lines), lines
    commands = [
        ["bash", "-c", line.replace("localhost:50051", f"localhost:{port}")]
        for line in lines
        if " -i " not in line + " "  # the interactive chat: the REPL's own tests drive it through a terminal
    ]
    assert len(commands) == len(lines) - 1

    curl = readme_block("## OpenAI-compatible HTTP API", "sh").replace("\\\n", "")
    assert curl.startswith("curl -N http://127.0.0.1:8000/"), curl  # never anything else from the README
    commands.append(["bash", "-c", curl.replace("127.0.0.1:8000", f"127.0.0.1:{http_port}")])
    for after, opening, address, real in (
        ("From Python", "from tokenmill_client import Client", "localhost:50051", f"localhost:{port}"),
        ("## OpenAI-compatible HTTP API", "from openai import OpenAI", "127.0.0.1:8000", f"127.0.0.1:{http_port}"),
    ):
        snippet = readme_block(after, "py(?:thon)?").replace(address, real)
        assert snippet.startswith(opening), snippet
        commands.append([sys.executable, "-c", snippet])

    env = {k: v for k, v in os.environ.items() if k != "TOKENMILL_TOKEN"}
    env["TOKENMILL_SERVER"] = f"localhost:{port}"
    running = [
        subprocess.Popen(
            command,
            cwd=REPO,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for command in commands
    ]
    for command, proc in zip(commands, running, strict=True):
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0 and out.strip(), (command[-1], err[-2000:])
        if command[-1].startswith("curl"):
            assert out.rstrip().endswith("data: [DONE]"), out[-500:]


# Found, not imported: that venv has the package's own files only (no grpc, no torch). Each is marked
# typed (py.typed beside its __init__), so type checkers read it rather than treat it as Any.
FOUND = (
    "import importlib.util as u, pathlib as p; "
    "specs = [u.find_spec(n) for n in ('tokenmill_client', 'tokenmill_service', 'tokenmill_bench')]; "
    "assert all(specs); assert all((p.Path(s.origin).parent / 'py.typed').is_file() for s in specs), specs"
)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_mypy_strict_sees_the_editable_install(tmp_path: Path) -> None:
    # Also the regression test for compat mode, which put only the project root on the path: neither
    # mypy nor Python could then import tokenmill_client (its sources are under client/).
    source = tmp_path / "tokenmill"
    shutil.copytree(REPO, source, ignore=_NOT_BUILD_INPUTS)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", venv], check=True, timeout=300)
    # The install mode `make install` uses (dependencies left out: only the package's own files matter here).
    installed = subprocess.run(
        [venv / "bin" / "python", "-m", "pip", "install", "-q", "--no-deps"]
        + ["--config-settings", "editable_mode=strict", "-e", str(source)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert installed.returncode == 0, installed.stderr
    user_code = tmp_path / "mine.py"
    user_code.write_text(
        "from tokenmill_client import Client, GenerateResult\n\n\n"
        "def ask(client: Client) -> GenerateResult:\n"
        '    return client.generate_text("Hi", max_new_tokens=4)\n'
    )
    checked = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--python-executable", str(venv / "bin" / "python")]
        + ["--no-incremental", str(user_code)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        check=False,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    imported = subprocess.run(
        [venv / "bin" / "python", "-c", FOUND],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        check=False,
    )
    assert imported.returncode == 0, imported.stderr
    assert re.search(r"Success: no issues found in 1 source file", checked.stdout)
