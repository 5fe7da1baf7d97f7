"""bench/step_python.py: the engine stepped in process on the embedded model, each part of a decoding step timed;
the parts it names are the step's native calls and the Python around them, and they add up to the step."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tokenmill_service.worker.kernels.cpu import build

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(build.unavailable_reason("decoder_stack") is not None, reason="no native kernels here")
def test_the_step_splits_into_its_native_calls_and_the_python_around_them() -> None:
    from tokenmill_service.contract.model_paths import resolve_model_path

    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "step_python.py"), "--model", str(resolve_model_path(None))]
        + ["--tokens", "8", "--runs", "1"],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    head = re.search(r"run 1: a step ([\d.]+) ms; outside the native calls ([\d.]+) ms", result.stdout)
    assert head, result.stdout
    step, outside = float(head[1]), float(head[2])
    parts = {m[1].strip(): float(m[2]) for m in re.finditer(r"^  (.+?)\s+(-?[\d.]+) ms$", result.stdout, re.MULTILINE)}
    assert {"decoder stack (native)", "embedding lookup", "sampler", "scheduler", "plan"} <= set(parts)
    assert all(ms >= 0 for ms in parts.values()), parts
    assert sum(parts.values()) == pytest.approx(step, abs=0.01)
    assert 0 < outside < step
