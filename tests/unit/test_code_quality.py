"""The project's own standards, checked like any other behaviour: ruff clean, every package typed strictly."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

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
MYPY_TARGETS = (
    "client/tokenmill_client", "client/examples", "service/tokenmill_service", "bench/tokenmill_bench",
    "bench/fuzz_grpc.py", "bench/soak.py", "bench/fidelity.py", "bench/streamed_reference.py",
    "bench/step_breakdown.py",
    "scripts/api_reference.py", "scripts/mkdocs_hooks.py",
)  # fmt: skip

PYTHON_BLOCK = re.compile(r"^```py(?:thon)?\n(.*?)^```", re.MULTILINE | re.DOTALL)

# The user documents: the README, docs/, and the chart's and the benchmark's documents.
USER_DOCS = (
    "README.md",
    *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")),
    "bench/README.md",
    "bench/RESULTS.md",
    "bench/history.md",
    "helm/tokenmill/README.md",
)


def _docs_examples(directory: Path) -> list[str]:
    """Every Python block of the README and docs/ as a module of its own in ``directory``."""
    scripts = []
    for doc in ("README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))):
        for i, example in enumerate(PYTHON_BLOCK.findall((ROOT / doc).read_text())):
            script = directory / f"{Path(doc).stem.replace('-', '_')}_{i}.py"
            script.write_text(example)
            scripts.append(str(script))
    return scripts


@pytest.fixture(scope="module")
def mypy_runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, subprocess.Popen[str]]]:
    """The two mypy runs below, started together: each is one process on one core for 20-30 s on a clean
    clone, so side by side they take the time of the longer. Each has its own cache (one cache written by two
    processes at once is not safe); warm, as in a developer's runs, each takes a second or two."""
    examples = _docs_examples(tmp_path_factory.mktemp("docs-examples"))
    assert len(examples) >= 4, examples  # the README's client, the docs' client, structured output and tools

    def start(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [str(BIN / "mypy"), "--strict", *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, env=env,
        )  # fmt: skip

    runs = {
        "code": start(*MYPY_TARGETS),
        # The examples' imports (the openai SDK) are no package's: MYPYPATH finds the client's sources.
        "examples": start(
            "--cache-dir", str(ROOT / ".mypy_cache" / "docs-examples"), *examples,
            env={**os.environ, "MYPYPATH": str(ROOT / "client")},
        ),
    }  # fmt: skip
    yield runs
    for process in runs.values():
        process.kill()
        process.wait()


def _finished(process: subprocess.Popen[str]) -> tuple[int, str]:
    output, _ = process.communicate(timeout=300)
    return process.returncode, output


def test_the_client_its_examples_the_service_and_the_bench_pass_mypy_strict(
    mypy_runs: dict[str, subprocess.Popen[str]],
) -> None:
    code, output = _finished(mypy_runs["code"])
    assert code == 0, output


def test_the_python_examples_of_the_readme_and_docs_pass_mypy_strict(
    mypy_runs: dict[str, subprocess.Popen[str]],
) -> None:
    """Every Python block of the README and docs/ (the typed client's and the `openai` SDK's examples), each
    as a module of its own, in one mypy run: what a reader copies type-checks as their own code would."""
    code, output = _finished(mypy_runs["examples"])
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
