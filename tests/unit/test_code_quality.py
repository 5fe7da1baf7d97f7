"""The project's own standards, checked like any other behaviour: ruff clean, every package typed strictly."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, check=False, timeout=300)


def test_ruff_finds_nothing_to_fix() -> None:
    result = run(str(BIN / "ruff"), "check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_code_is_ruff_formatted() -> None:
    result = run(str(BIN / "ruff"), "format", "--check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


# Every package in one mypy run (as `make lint` runs it), so that the standard library's and torch's
# stubs are read once.
MYPY_TARGETS = ("client/tokenmill_client", "client/examples", "service/tokenmill_service", "bench/tokenmill_bench")


def test_the_client_its_examples_the_service_and_the_bench_pass_mypy_strict() -> None:
    result = run(str(BIN / "mypy"), "--strict", *MYPY_TARGETS)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_readme_python_example_passes_mypy_strict(tmp_path: Path) -> None:
    readme = (ROOT / "README.md").read_text()
    example = readme.split("```python\n", 1)[1].split("```", 1)[0]
    script = tmp_path / "readme_example.py"
    script.write_text(example)
    result = subprocess.run(
        [str(BIN / "mypy"), "--strict", "--no-incremental", str(script)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
        env={**os.environ, "MYPYPATH": str(ROOT / "client")},
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_user_docs_name_no_internal_process_words() -> None:
    """The README, the chart's and bench/'s docs speak to users: no issue numbers, no lettered runs of
    a work session, no paths of the machine they were written on."""
    import re

    internal = re.compile(
        r"\bissue \d+|\bissue's\b|\b[Rr]uns? [A-I]\b(?![-\w])|/work/|\bseams issue\b|\bthis session\b"
    )
    for doc in ("README.md", "bench/README.md", "bench/RESULTS.md", "helm/tokenmill/README.md"):
        for number, line in enumerate((ROOT / doc).read_text().splitlines(), 1):
            assert not internal.search(line), f"{doc}:{number}: {line}"
