"""The base install (no extras) is the client alone: grpcio and protobuf, no torch.

Slow-ish (a clean virtual environment and a real `pip install`, about a minute), but part of `make test`:
it is what keeps the client importable and its CLI runnable without the server's dependencies.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server_process import free_port

REPO = Path(__file__).resolve().parents[2]

# Not part of the package build; the copy leaves them out so that nothing in the working tree is
# written to (setuptools builds in the source directory) and the copy stays small.
_NOT_BUILD_INPUTS = shutil.ignore_patterns(
    ".git", ".venv", ".tools", ".mypy_cache", ".ruff_cache", ".pytest_cache", "__pycache__",
    "build", "dist", "*.egg-info", "tests", "helm", "bench/out",
)  # fmt: skip


def _run(*args: str | Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=timeout, check=False)


@pytest.fixture(scope="module")
def light_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("light-install")
    source = root / "tokenmill"
    shutil.copytree(REPO, source, ignore=_NOT_BUILD_INPUTS)
    venv = root / "venv"
    made = _run(sys.executable, "-m", "venv", venv)  # a clean one: no --system-site-packages
    assert made.returncode == 0, made.stderr
    installed = _run(venv / "bin" / "python", "-m", "pip", "install", "-q", source)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    return venv


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_base_install_imports_the_client_without_torch(light_venv: Path) -> None:
    python = light_venv / "bin" / "python"
    imported = _run(
        python, "-c", "import tokenmill_client, tokenmill_client.cli; print(tokenmill_client.GenerateOptions(seed=1))"
    )
    assert imported.returncode == 0, imported.stderr
    assert "GenerateOptions(max_new_tokens=0" in imported.stdout and "seed=1" in imported.stdout
    torch = _run(python, "-c", "import torch")
    assert torch.returncode != 0
    assert "No module named 'torch'" in torch.stderr
    pip_list = _run(python, "-m", "pip", "list", "--format=freeze")
    names = {line.split("==")[0].lower() for line in pip_list.stdout.splitlines()}
    assert {"grpcio", "protobuf", "tokenmill"} <= names
    assert not names & {"torch", "numpy", "grpcio-tools", "structlog"}
    # Only the project's packages are installed: not client/examples as a top-level "examples".
    stray = _run(python, "-c", "import examples")
    assert stray.returncode != 0, "client/examples was installed as a top-level package"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_base_install_runs_the_cli(light_venv: Path) -> None:
    cli = light_venv / "bin" / "tokenmill-client"
    help_ = _run(cli, "--help")
    assert help_.returncode == 0, help_.stderr
    assert "generate" in help_.stdout
    address = f"127.0.0.1:{free_port()}"
    unreachable = _run(cli, "--server", address, "--max-retries", "0", "health")
    assert unreachable.returncode == 1
    assert unreachable.stderr.startswith("error: ") and address in unreachable.stderr
    assert "Traceback" not in unreachable.stderr


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_base_install_server_and_bench_say_how_to_install_the_server_extra(light_venv: Path) -> None:
    for command in ("tokenmill-server", "tokenmill-bench"):
        proc = _run(light_venv / "bin" / command, "--help")
        assert proc.returncode == 1
        assert proc.stderr.startswith(f"{command}: ") and "pip install 'tokenmill[server]'" in proc.stderr
        assert "Traceback" not in proc.stderr
