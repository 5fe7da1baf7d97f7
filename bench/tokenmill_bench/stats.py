"""Small statistics helpers: percentiles without numpy, so the load generator stays light."""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100) by linear interpolation between closest ranks (numpy's default); None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    lo = math.floor(rank)
    hi = math.ceil(rank)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def summarize_ms(values_s: Sequence[float]) -> dict[str, float | int | None]:
    """p50/p90/p99/max/mean of durations given in seconds, reported in milliseconds."""
    ms = [v * 1000.0 for v in values_s]
    return {
        "p50": percentile(ms, 50),
        "p90": percentile(ms, 90),
        "p99": percentile(ms, 99),
        "max": max(ms) if ms else None,
        "mean": sum(ms) / len(ms) if ms else None,
        "count": len(ms),
    }
