"""Where a step's time goes inside the native decoder stack (decoder_stack.cpp), for bench/step_breakdown.py.

With ``TM_STACK_PROFILE=1`` in a worker's environment the stack sums the time of its products, attention and
experts; ``read_and_reset`` hands the sums since its last call to the worker's ``step_timing`` log line.
"""

from __future__ import annotations

import ctypes
import os

from tokenmill_service.worker.kernels.cpu import build

ENABLED = os.environ.get("TM_STACK_PROFILE", "0") not in ("", "0")
_FIELDS = ("stack_products_ms", "stack_attention_ms", "stack_experts_ms", "stack_ms")


def read_and_reset() -> dict[str, float]:
    """The stack's sums since the last read, in ms (and its calls), or nothing when not profiling or when this
    process has not loaded the stack."""
    if not ENABLED or build.unavailable_reason("decoder_stack") is not None:
        return {}
    out = (ctypes.c_int64 * (len(_FIELDS) + 1))()
    build.load("decoder_stack").tm_stack_profile(out)
    figures = {name: round(out[i] / 1e6, 3) for i, name in enumerate(_FIELDS)}
    return {**figures, "stack_calls": float(out[len(_FIELDS)])}
