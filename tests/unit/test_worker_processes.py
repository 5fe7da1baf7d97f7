"""Where worker processes come from: the fork server on Linux, started only when workers will be."""

from __future__ import annotations

import importlib.util
import sys
from multiprocessing import forkserver

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
