"""What a newcomer meets first: `make run`'s output, and type-checking their own code against `make install`."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
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


@pytest.mark.timeout(600)
def test_make_run_prints_one_copy_pasteable_banner_with_the_real_paths() -> None:
    port, http_port = free_port(), free_port()
    # -o: the install step counts as done (`make test` has just run it), so this starts the server alone.
    make = shutil.which("make") or "make"
    session = PtySession(
        [make, "-C", str(REPO), "-o", STAMP, "-o", LINKED, "run", f"PORT={port}", f"HTTP_PORT={http_port}"]
    )
    try:
        session.expect(r"tokenmill is ready: ", timeout=400)
        block = session.expect(r"(?s)\n\n(.*?)\n\nCtrl-C stops the server\.", timeout=30).group(1)
        commands = [line.strip() for line in block.splitlines()]
        assert len(commands) == 4
        assert "pip" not in session.output.lower()
        client = shlex.split(commands[0])
        exe = Path(client[0]) if Path(client[0]).is_absolute() else REPO / client[0]
        assert exe.name == "tokenmill-client" and os.access(exe, os.X_OK)
        assert commands[2].split()[0] in (".tools/bin/grpcurl", "grpcurl")
        assert commands[3].startswith(f"curl -N http://127.0.0.1:{http_port}/v1/chat/completions")
        # The first command works as pasted, from the repository's root.
        answer = subprocess.run(
            [str(exe), *client[1:], "-l", "8"], cwd=REPO, capture_output=True, text=True, timeout=300, check=False
        )
        assert answer.returncode == 0 and "Paris" in answer.stdout, answer.stderr
        session.send("\x03")  # Ctrl-C: the server drains and stops
        session.expect("server_stopped", timeout=120)
    finally:
        if session.proc.poll() is None:
            os.killpg(session.proc.pid, signal.SIGTERM)
        session.close()


# Found, not imported: that venv has the package's own files only (no grpc, no torch).
FOUND = "import importlib.util as u; assert all(map(u.find_spec, ['tokenmill_client', 'tokenmill_service', 'tokenmill_bench']))"


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
