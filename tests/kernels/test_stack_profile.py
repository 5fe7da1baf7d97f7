"""The native decoder stack's profile (TM_STACK_PROFILE=1, bench/step_breakdown.py's source): it sums the time of
the products and attention inside the stack and hands the sums over once; without the variable it says nothing.
The library reads the variable when it loads, so each case runs in a fresh interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tokenmill_service.worker.kernels.cpu import build

CODE = """
import json
from tokenmill_service.worker.engine.model_runner import forward_prompt
from tokenmill_service.worker.kernels.cpu import stack_profile
from tokenmill_service.worker.loader import load
from tokenmill_service.contract.plan import LoadOptions

model = load(LoadOptions())
forward_prompt(model, list(range(1, 40)))
print(json.dumps([stack_profile.read_and_reset(), stack_profile.read_and_reset()]))
"""


def _profiles(env_value: str) -> list[dict[str, float]]:
    env = {**os.environ, "TM_STACK_PROFILE": env_value}
    result = subprocess.run(
        [sys.executable, "-c", CODE], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    profiles: list[dict[str, float]] = json.loads(result.stdout.strip().splitlines()[-1])
    return profiles


@pytest.mark.skipif(build.unavailable_reason("decoder_stack") is not None, reason="no native kernels here")
def test_the_stack_profile_sums_its_products_and_attention_and_resets() -> None:
    first, second = _profiles("1")
    assert first["stack_calls"] == 1
    assert first["stack_products_ms"] > 0 and first["stack_attention_ms"] > 0 and first["stack_experts_ms"] == 0
    assert first["stack_ms"] >= first["stack_products_ms"] + first["stack_attention_ms"]
    assert second == {name: 0.0 for name in first}


@pytest.mark.skipif(build.unavailable_reason("decoder_stack") is not None, reason="no native kernels here")
def test_without_the_variable_the_stack_keeps_no_profile() -> None:
    assert _profiles("0") == [{}, {}]
