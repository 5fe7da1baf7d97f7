"""The project's own standards, checked like any other behaviour: ruff clean, the client typed strictly."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, check=False, timeout=300)


def test_ruff_finds_nothing_to_fix() -> None:
    result = run(str(BIN / "ruff"), "check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_code_is_ruff_formatted() -> None:
    result = run(str(BIN / "ruff"), "format", "--check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_client_and_its_example_pass_mypy_strict() -> None:
    result = run(str(BIN / "mypy"), "--strict", "client/tokenmill_client", "client/examples")
    assert result.returncode == 0, result.stdout + result.stderr
