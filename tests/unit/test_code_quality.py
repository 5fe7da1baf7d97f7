"""The project's own standards, checked like any other behaviour: ruff clean, every package typed strictly."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests import mypy_runs

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


# The user documents: the README, docs/, and the chart's and the benchmark's documents.
USER_DOCS = (
    "README.md",
    *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")),
    "bench/README.md",
    "bench/RESULTS.md",
    "bench/history.md",
    "helm/tokenmill/README.md",
)


def test_the_client_its_examples_the_service_and_the_bench_pass_mypy_strict() -> None:
    """``make lint``'s mypy run, started in the background when the session collected this test (mypy_runs.py)."""
    code, output, _ = mypy_runs.outcome("code")
    assert code == 0, output


def test_the_python_examples_of_the_readme_and_docs_pass_mypy_strict() -> None:
    """Every Python block of the README and docs/ (the typed client's and the `openai` SDK's examples), each
    as a module of its own, in one mypy run: what a reader copies type-checks as their own code would."""
    code, output, examples = mypy_runs.outcome("examples")
    assert examples >= 4, examples  # the README's client, the docs' client, structured output and tools
    assert code == 0, output


def test_the_user_docs_name_no_internal_process_words() -> None:
    """The README, docs/, the chart's and bench/'s docs speak to users: no issue numbers, no lettered runs
    of a work session, no paths of the machine they were written on."""
    internal = re.compile(
        r"\bissue \d+|\bissue's\b|\b[Rr]uns? [A-I]\b(?![-\w])|/work/|\bseams issue\b|\bthis session\b"
        r"|\bthis task\b"
    )
    assert len(USER_DOCS) > 8  # docs/ is read
    for doc in USER_DOCS:
        for number, line in enumerate((ROOT / doc).read_text().splitlines(), 1):
            assert not internal.search(line), f"{doc}:{number}: {line}"
