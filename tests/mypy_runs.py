"""The two mypy runs of tests/unit/test_code_quality.py, in the background at the lowest priority, started with
the service tier where the session runs them (tests/conftest.py): each is one process on one core for 20-30 s on
a clean clone, and the service tests leave a core idle much of the time (servers waiting on their workers), so by
the time the unit tests run (the last tier) they have finished. Their tests only read the outcome (a session
without service tests starts them there).

Each run has its own cache (one cache written by two processes at once is not safe); warm, as in a developer's
runs, each takes a second or two. A process of its own session, at nice 19 there too, for the reason
tests/native/background_builds.py gives."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

# Every package in one mypy run (as `make lint` runs it), so that the standard library's and torch's
# stubs are read once.
MYPY_TARGETS = (
    "client/tokenmill_client", "client/examples", "service/tokenmill_service", "bench/tokenmill_bench",
    "bench/fuzz_grpc.py", "bench/soak.py", "bench/fidelity.py", "bench/streamed_reference.py",
    "bench/step_breakdown.py", "bench/step_python.py",
    "scripts/api_reference.py", "scripts/mkdocs_hooks.py",
)  # fmt: skip

PYTHON_BLOCK = re.compile(r"^```py(?:thon)?\n(.*?)^```", re.MULTILINE | re.DOTALL)

# At the lowest priority, in its session's group too (where Linux groups the CPU's time by session).
_LOWEST = 'echo 19 > /proc/self/autogroup 2>/dev/null; exec nice -n 19 "$@"'

# Whether the session runs the mypy tests (set when it has collected them).
wanted = False
_runs: dict[str, subprocess.Popen[str]] = {}
_examples_dir: str | None = None


def docs_examples(directory: Path) -> list[str]:
    """Every Python block of the README and docs/ as a module of its own in ``directory``."""
    scripts = []
    for doc in ("README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))):
        for i, example in enumerate(PYTHON_BLOCK.findall((ROOT / doc).read_text())):
            script = directory / f"{Path(doc).stem.replace('-', '_')}_{i}.py"
            script.write_text(example)
            scripts.append(str(script))
    return scripts


def _start(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        ["sh", "-c", _LOWEST, "sh", str(BIN / "mypy"), "--strict", *args], cwd=ROOT, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True,
    )  # fmt: skip


def start() -> None:
    """Starts both runs (once)."""
    global _examples_dir
    if _runs:
        return
    _examples_dir = tempfile.mkdtemp(prefix="docs-examples-")
    examples = docs_examples(Path(_examples_dir))
    _runs["code"] = _start(*MYPY_TARGETS)
    # The examples' imports (the openai SDK) are no package's: MYPYPATH finds the client's sources.
    _runs["examples"] = _start(
        "--cache-dir", str(ROOT / ".mypy_cache" / "docs-examples"), *examples,
        env={**os.environ, "MYPYPATH": str(ROOT / "client")},
    )  # fmt: skip


def outcome(name: str) -> tuple[int, str, int]:
    """Run ``name`` ("code" or "examples") to its end: its exit code, what it printed, and how many examples
    the examples' run checks."""
    start()
    process = _runs[name]
    output, _ = process.communicate(timeout=300)
    assert _examples_dir is not None
    return process.returncode, output, len(list(Path(_examples_dir).glob("*.py")))


def stop() -> None:
    """At the session's end: whatever still runs is killed, the examples' folder removed."""
    for process in _runs.values():
        if process.poll() is None:
            os.killpg(process.pid, 9)
        process.wait()
    if _examples_dir is not None:
        shutil.rmtree(_examples_dir, ignore_errors=True)
