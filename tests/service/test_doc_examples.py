"""Every shell and Python example of the README and docs/ runs against a real server, as a reader pastes it.

The examples are written for `make run`'s server (gRPC on localhost:50051, HTTP on 127.0.0.1:8000, the
tools under .venv/bin and .tools/bin); each runs here with those addresses pointed at this module's server,
which stops a request that sets no token limit at 64 tokens. A Python block runs as one program, a shell block
as one process per command (as a reader pastes its lines); all run at once (the server batches them), and each
must exit 0, each block having printed something. A block that needs what the suite cannot give (a cluster, a GPU, model files, a download, `make run`
itself) says so in the Markdown, on the line before it: ``<!-- not run: why -->``; each is reported as
skipped with its reason.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.server_process import ServerProcess

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
DOCS = ("README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")))
BLOCK = re.compile(
    r"(?:^<!-- not run: (?P<why>[^\n]*?) -->\n)?^```(?P<lang>sh|bash|py|python)\n(?P<body>.*?)^```",
    re.MULTILINE | re.DOTALL,
)


@dataclass(frozen=True)
class Example:
    doc: str
    line: int
    lang: str
    body: str
    not_run: str | None

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"


def examples(doc: str) -> list[Example]:
    text = (ROOT / doc).read_text()
    return [
        Example(doc, text.count("\n", 0, m.start("body")), m["lang"], m["body"], m["why"]) for m in BLOCK.finditer(text)
    ]


ALL = [example for doc in DOCS for example in examples(doc)]
NOT_RUN = [example for example in ALL if example.not_run is not None]


def grpcurl() -> str | None:
    found = ROOT / ".tools" / "bin" / "grpcurl"  # where `make tools` (and `make test`) puts it
    return str(found) if found.is_file() else shutil.which("grpcurl")


def as_run_here(example: Example, server: ServerProcess) -> str:
    """The block with `make run`'s addresses and paths replaced by the test server's and this environment's."""
    body = re.sub(r"\b(localhost|127\.0\.0\.1):50051\b", server.address, example.body)
    body = re.sub(r"\b(localhost|127\.0\.0\.1):8000\b", f"127.0.0.1:{server.http_port}", body)
    if example.lang in ("sh", "bash"):
        body = body.replace(".venv/bin/", f"{BIN}/").replace(".tools/bin/grpcurl", grpcurl() or "grpcurl")
    return body


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    """The default server, but that a request that sets no limit stops at 64 tokens rather than 1024: the
    examples that set none (a tool round trip, an agent) then take seconds, as they would on a reader's GPU."""
    with ServerProcess("--default-max-new-tokens", "64", "--drain-seconds", "5") as proc:
        yield proc


def test_the_docs_have_examples_and_each_one_not_run_says_why() -> None:
    assert len(ALL) >= 30, len(ALL)
    assert len(ALL) - len(NOT_RUN) >= 15, [e.where for e in ALL if e.not_run is None]
    assert all(e.not_run and len(e.not_run) > 10 for e in NOT_RUN), [e.where for e in NOT_RUN]


@pytest.mark.parametrize("example", NOT_RUN, ids=[e.where for e in NOT_RUN])
def test_an_example_marked_not_run(example: Example) -> None:
    pytest.skip(f"{example.where}: not run: {example.not_run}")


def commands(example: Example, body: str) -> list[list[str]]:
    """What runs for a block: a Python block as one program; a shell block a process per command (its lines
    with their continuations joined, comments left out), as a reader pastes them one by one."""
    if example.lang.startswith("py"):
        return [[sys.executable, "-c", body]]
    found, pending = [], ""
    for line in body.replace("\\\n", " ").splitlines():
        pending += line + "\n"
        try:
            complete = bool(shlex.split(pending, comments=True))
        except ValueError:  # a quote still open: the command goes on on the next line
            continue
        if complete:
            found.append(["bash", "-e", "-o", "pipefail", "-c", pending])
        pending = ""
    assert not pending.strip(), f"{example.where}: an unfinished command: {pending}"
    return found


@pytest.mark.timeout(600)
def test_every_example_runs_as_written(server: ServerProcess) -> None:
    runnable = [e for e in ALL if e.not_run is None]
    if any(".tools/bin/grpcurl" in e.body for e in runnable) and grpcurl() is None:
        pytest.skip("grpcurl is not installed (`make tools` installs it)")
    env = {k: v for k, v in os.environ.items() if k != "TOKENMILL_TOKEN"}
    env["TOKENMILL_SERVER"] = server.address  # the CLI's default address, localhost:50051 under `make run`
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    # Every command at once, as several readers would (the server batches them); one that two documents
    # both show (the CLI's, in the README and docs/client.md) runs once for both.
    where: dict[tuple[str, ...], list[Example]] = {}
    for example in runnable:
        for argv in commands(example, as_run_here(example, server)):
            where.setdefault(tuple(argv), []).append(example)
    assert len(where) >= 20, len(where)
    running = [
        (command, subprocess.Popen(
            command, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True,
        ))
        for command in where
    ]  # fmt: skip
    printed: dict[str, str] = {}
    failed = []
    for command, proc in running:
        out, err = proc.communicate(timeout=540)
        places = ", ".join(e.where for e in where[command])
        for example in where[command]:
            printed[example.where] = printed.get(example.where, "") + out
        if proc.returncode != 0:
            failed.append(f"{places} exited {proc.returncode}: {command[-1]}\n--- stderr:\n{err[-2000:]}")
    failed += [f"{place} printed nothing" for place, out in printed.items() if not out.strip()]
    assert not failed, "\n\n".join(failed)
