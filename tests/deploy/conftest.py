"""The deploy tier's shared fixture: an isolated home for the helm binary the chart tests run."""

from __future__ import annotations

import os

import pytest

from tests.deploy.test_helm_chart import HELM


@pytest.fixture(scope="session")
def helm_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    if not (HELM.exists() and os.access(HELM, os.X_OK)):
        pytest.fail(f"{HELM} is missing: run `make tools` (bash scripts/install_tools.sh)")
    home = tmp_path_factory.mktemp("helm-home")
    env = dict(os.environ)
    env.update(
        HELM_CACHE_HOME=str(home / "cache"),
        HELM_CONFIG_HOME=str(home / "config"),
        HELM_DATA_HOME=str(home / "data"),
    )
    return env
