"""Shared fixtures (the default model's tokenizer and models, one default server, loaded once per
session), and each test's tier marked from its folder: unit, kernels, engine, service, deploy."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.server_process import ServerProcess

# Triton reads TRITON_INTERPRET when it is first imported, and some test modules import it while they are
# collected (sentence-transformers does, through transformers): where there is no NVIDIA GPU, its interpreter
# is switched on here, before any test module is collected (tests/triton_setup.py checks it). The servers the
# tests start inherit it, as they did once the triton tests' modules were collected.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

DATA = Path(__file__).parent / "data"
TIERS = ("unit", "kernels", "engine", "service", "deploy")


def pytest_sessionstart(session: pytest.Session) -> None:
    """Every kernel this CPU's servers load built ahead, a compiler a core, rather than one at a time as the tests
    first load them (half the time on a fresh machine)."""
    from tests.native import runner

    runner.prebuild_own()


def pytest_collection_finish(session: pytest.Session) -> None:
    """The builds only the bit-for-bit checks load, in the background, when the session runs their tests; and
    whether it runs the mypy tests."""
    from tests import mypy_runs
    from tests.native import runner

    if any(item.path.name in runner.LOAD_OTHER_BUILDS for item in session.items):
        runner.start_the_other_builds()
    if any(item.path.name == "test_code_quality.py" and "mypy" in item.name for item in session.items):
        mypy_runs.wanted = True


def pytest_runtest_setup(item: pytest.Item) -> None:
    """The mypy runs start with the service tier (minutes of servers waiting on their workers), once the other
    builds, which the kernel tier before it waits for, have had the idle core; their tests, in the unit tier, come
    after it."""
    from tests import mypy_runs

    if mypy_runs.wanted and item.path.relative_to(Path(__file__).parent).parts[0] == "service":
        mypy_runs.start()


def pytest_sessionfinish(session: pytest.Session) -> None:
    from tests import mypy_runs
    from tests.native import runner

    runner.stop_the_other_builds()
    mypy_runs.stop()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """``-m unit`` (or kernels, engine, service, deploy) selects a tier: the folder a test lives in."""
    root = Path(__file__).parent
    for item in items:
        tier = item.path.relative_to(root).parts[0]
        if tier in TIERS:
            item.add_marker(getattr(pytest.mark, tier))


@pytest.fixture(scope="session")
def reference() -> dict[str, Any]:
    """Token ids and logits for SmolLM2 from independent implementations (llama.cpp, transformers)."""
    return json.loads((DATA / "smollm2_reference.json").read_text())


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    from tokenmill_service.worker.loader import resolve_model_path

    return resolve_model_path(None)


@pytest.fixture(scope="session")
def default_tokenizer(default_model_path: Path) -> Any:
    from tokenmill_service.contract.tokenizer import load_tokenizer

    return load_tokenizer(default_model_path)


@pytest.fixture(scope="session")
def default_model(default_model_path: Path) -> Any:
    """The reference configuration: float32, unquantized (what reproduces ../shared/reference)."""
    from tokenmill_service.worker.loader import load_model

    return load_model(default_model_path)


@pytest.fixture(scope="session")
def served_model(default_model_path: Path) -> Any:
    """The model as the server runs it by default: every option at its default (the GGUF's blocks as
    stored, the native decoder stack), loaded as a worker loads it."""
    from tokenmill_service.contract.plan import LoadOptions
    from tokenmill_service.worker.loader import load

    return load(LoadOptions())


@pytest.fixture(scope="session")
def compiled_model(default_model_path: Path) -> Any:
    """The served model with --compile auto: its regions through torch.compile (compiled on first use)."""
    from tokenmill_service.contract.plan import LoadOptions
    from tokenmill_service.worker.loader import load

    model = load(LoadOptions(compile="auto"))
    assert model.plan.executor.value == "compiled", f"torch.compile is unavailable here: {model.plan.skipped}"
    return model


@pytest.fixture(scope="session")
def server() -> Iterator[ServerProcess]:
    """One real server in the default configuration (embedded model, one worker) shared by the integration tests."""
    proc = ServerProcess("--drain-seconds", "5", metrics=True).start()
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def server_address(server: ServerProcess) -> str:
    return server.address
