"""Where worker processes come from: the fork server on Linux, started only when workers will be."""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import os
import sys
from collections.abc import Iterator
from multiprocessing import forkserver
from pathlib import Path

import pytest

from tokenmill_service.front import worker_processes


@pytest.mark.parametrize("argv", [["--help"], ["-h"], ["--model", "m.gguf", "--version"]])
def test_a_command_line_that_only_asks_for_help_starts_no_fork_server(argv: list[str]) -> None:
    before = forkserver._forkserver._forkserver_pid  # type: ignore[attr-defined]
    worker_processes.start_preloading(argv)
    assert forkserver._forkserver._forkserver_pid == before  # type: ignore[attr-defined]


def test_workers_are_forked_on_linux_and_spawned_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    assert worker_processes.context().get_start_method() == ("forkserver" if sys.platform == "linux" else "spawn")
    monkeypatch.setattr(sys, "platform", "darwin")
    assert worker_processes.context().get_start_method() == "spawn"
    before = forkserver._forkserver._forkserver_pid  # type: ignore[attr-defined]
    worker_processes.start_preloading([])
    assert forkserver._forkserver._forkserver_pid == before  # type: ignore[attr-defined]


def test_every_preloaded_module_exists() -> None:
    """The fork server skips a module it cannot import without a word: each must be there."""
    for name in worker_processes.PRELOADED:
        assert importlib.util.find_spec(name) is not None, name


@pytest.fixture
def own_fork_server(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """This process's fork server stopped before and after (its preloads as they were), and the file the probe
    module writes if the fork server's exit runs the interpreter's exit handlers."""
    if not worker_processes.forking():
        pytest.skip("no fork server off Linux")
    worker_processes.stop_helpers()
    preload = list(forkserver._forkserver._preload_modules)  # type: ignore[attr-defined]
    probe = tmp_path / "torn-down"
    monkeypatch.setenv("TOKENMILL_FORK_SERVER_PROBE", str(probe))  # the fork server's environment is this one's
    yield probe
    worker_processes.stop_helpers()
    mp.get_context("forkserver").set_forkserver_preload(preload)


def _start_fork_server(preload: list[str]) -> int:
    mp.get_context("forkserver").set_forkserver_preload(preload)
    forkserver.ensure_running()
    # The fork server imports its preloads before it serves: a fork asked of it waits for them.
    child = mp.get_context("forkserver").Process(target=os.getpid)
    child.start()
    child.join(60)
    pid = forkserver._forkserver._forkserver_pid  # type: ignore[attr-defined]
    assert isinstance(pid, int)
    return pid


def _exited(pid: int) -> bool:
    return not Path(f"/proc/{pid}").exists()


def test_the_fork_server_is_stopped_and_waited_for_and_leaves_without_tearing_down(own_fork_server: Path) -> None:
    """stop_helpers (called as the server process exits) stops the fork server and reaps it before returning; the
    fork server leaves at once (tokenmill_service.front.fork_server, preloaded last), so no exit handler of the
    modules it imported runs: the probe's would write its file."""
    assert worker_processes.PRELOADED[-1] == "tokenmill_service.front.fork_server"  # its handler registered last
    pid = _start_fork_server(["tests.fork_server_probe", worker_processes.PRELOADED[-1]])
    worker_processes.stop_helpers()
    assert _exited(pid)  # reaped, not a zombie
    assert not own_fork_server.exists()


def test_without_the_quick_exit_the_fork_servers_exit_handlers_run(own_fork_server: Path) -> None:
    """The other side of the test above, so that it can fail: a fork server without the quick exit runs them."""
    pid = _start_fork_server(["tests.fork_server_probe"])
    worker_processes.stop_helpers()
    assert _exited(pid)
    assert own_fork_server.read_text() == "torn down\n"
