"""tokenmill beside a peer server: the same figures for both at each concurrency, and their ratios.

Every ratio is tokenmill ÷ peer, whatever the metric: above 1 is better for tokens/s and bandwidth,
below 1 is better for latencies. Memory bandwidth achieved = bytes of weights read per decode step ×
steps per second, where a step gives every running stream one token, so steps/s is the per-stream
decode rate. Each side reads its own weight bytes: tokenmill its served dtype (a GGUF is dequantized
on load), llama.cpp the quantized tensors as stored.
"""

from __future__ import annotations

from typing import Any

# (key, label, digits) in the order printed; the key names a figure of a level's summary or of this module.
METRICS: tuple[tuple[str, str, int], ...] = (
    ("throughput_tok_s", "tok/s", 1),
    ("per_stream_decode_tok_s", "per-stream decode tok/s", 1),
    ("ttft_ms_p50", "TTFT p50 ms", 1),
    ("ttft_ms_p99", "TTFT p99 ms", 1),
    ("itl_ms_p50", "ITL p50 ms", 2),
    ("itl_ms_p99", "ITL p99 ms", 2),
    ("bandwidth_gbs", "bandwidth achieved GB/s", 2),
    ("bandwidth_share", "  of measured read bandwidth", 2),
)


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def level_figures(level: dict[str, Any], weight_bytes: int | None, read_gbs: float | None) -> dict[str, float | None]:
    """The compared figures of one level's summary (see ``load.LevelResult.summary``)."""
    steps_per_s = level["per_stream_decode_tok_s"] or None
    bandwidth = weight_bytes * steps_per_s / 1e9 if weight_bytes and steps_per_s else None
    return {
        "throughput_tok_s": level["throughput_tok_s"],
        "per_stream_decode_tok_s": steps_per_s,
        "ttft_ms_p50": level["ttft_ms"]["p50"],
        "ttft_ms_p99": level["ttft_ms"]["p99"],
        "itl_ms_p50": level["itl_ms"]["p50"],
        "itl_ms_p99": level["itl_ms"]["p99"],
        "bandwidth_gbs": bandwidth,
        "bandwidth_share": ratio(bandwidth, read_gbs),
    }


def compare_levels(
    ours: list[dict[str, Any]],
    theirs: list[dict[str, Any]],
    *,
    weight_bytes: int | None,
    peer_weight_bytes: int | None,
    read_gbs: float | None,
) -> list[dict[str, Any]]:
    """One entry per concurrency both sides ran: ``{"concurrency", "tokenmill", "peer", "ratio"}``, each a
    dict keyed like ``METRICS``."""
    by_concurrency = {level["concurrency"]: level for level in theirs}
    rows = []
    for level in ours:
        peer_level = by_concurrency.get(level["concurrency"])
        if peer_level is None:
            continue
        a = level_figures(level, weight_bytes, read_gbs)
        b = level_figures(peer_level, peer_weight_bytes, read_gbs)
        rows.append(
            {
                "concurrency": level["concurrency"],
                "tokenmill": a,
                "peer": b,
                "ratio": {key: ratio(a[key], b[key]) for key in a},
                "failed": {"tokenmill": level["failed_requests"], "peer": peer_level["failed_requests"]},
            }
        )
    return rows


def compare_first_requests(
    first: dict[str, dict[str, Any] | None], steady: dict[str, dict[str, Any]]
) -> dict[str, dict[str, float | None]]:
    """The first request a side served (cold) beside its single-stream level's medians (warm), per side:
    TTFT and total latency of a request of the same shape, and cold ÷ warm."""
    out = {}
    for side, row in first.items():
        level = steady[side]
        totals = sorted(r["total_ms"] for r in level["per_request"] if r["total_ms"] is not None and not r["error"])
        warm_total = totals[len(totals) // 2] if totals else None
        cold_ttft = row["ttft_ms"] if row else None
        cold_total = row["total_ms"] if row else None
        out[side] = {
            "first_ttft_ms": cold_ttft,
            "steady_ttft_ms_p50": level["ttft_ms"]["p50"],
            "first_total_ms": cold_total,
            "steady_total_ms_p50": warm_total,
            "ttft_cold_over_warm": ratio(cold_ttft, level["ttft_ms"]["p50"]),
            "total_cold_over_warm": ratio(cold_total, warm_total),
        }
    return out


def compare_long_prompts(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> dict[str, Any]:
    """Time to first token for single long prompts on both sides, their ratio, and how each side's time grows
    from the shortest prompt to the longest (the growth a linear prefill would show is the length ratio)."""
    theirs_by_length = {row["prompt_tokens"]: row for row in theirs}
    rows = []
    for row in ours:
        other = theirs_by_length.get(row["prompt_tokens"])
        if other is None:
            continue
        rows.append(
            {
                "prompt_tokens": row["prompt_tokens"],
                "tokenmill_ttft_ms": row["ttft_ms"],
                "peer_ttft_ms": other["ttft_ms"],
                "ratio": ratio(row["ttft_ms"], other["ttft_ms"]),
                # Each side's median over this many fresh prompts (results files before the tries: one).
                "tries": len(row.get("ttft_ms_each") or [None]),
                "errors": [e for e in (row["error"], other["error"]) if e],
            }
        )
    growth = None
    if len(rows) >= 2:
        short, long = rows[0], rows[-1]
        growth = {
            "from_tokens": short["prompt_tokens"],
            "to_tokens": long["prompt_tokens"],
            "length_ratio": long["prompt_tokens"] / short["prompt_tokens"],
            "tokenmill": ratio(long["tokenmill_ttft_ms"], short["tokenmill_ttft_ms"]),
            "peer": ratio(long["peer_ttft_ms"], short["peer_ttft_ms"]),
        }
    return {"rows": rows, "growth": growth}
