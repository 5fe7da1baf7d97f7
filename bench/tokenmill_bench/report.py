"""Turns a run's results into the JSON document and the printed tables."""

from __future__ import annotations

from typing import Any


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def headline(single: dict[str, Any], levels: list[dict[str, Any]], weight_bytes: int | None) -> dict[str, Any]:
    """The top-level keys: single-stream figures, throughput by concurrency, bandwidth, failures, ratios."""
    single_tok_s = single["per_stream_decode_tok_s"] or None
    by_level = {str(level["concurrency"]): level for level in levels}
    throughput = {c: level["throughput_tok_s"] for c, level in by_level.items()}
    # The single-stream run is the concurrency-1 level, measured even when 1 is not in the reported levels.
    base = single["throughput_tok_s"] or None
    bandwidth = weight_bytes * single_tok_s / 1e9 if weight_bytes and single_tok_s else None
    single_e2e = single["throughput_tok_s"] or None
    return {
        "single_stream_tok_s": single_tok_s,
        "single_stream_e2e_tok_s": single_e2e,
        "ttft_ms_p50": single["ttft_ms"]["p50"],
        "itl_ms_p50": single["itl_ms"]["p50"],
        "itl_ms_p99": single["itl_ms"]["p99"],
        "throughput_tok_s": throughput,
        "ttft_ms_p50_by_concurrency": {c: level["ttft_ms"]["p50"] for c, level in by_level.items()},
        "itl_ms_p50_by_concurrency": {c: level["itl_ms"]["p50"] for c, level in by_level.items()},
        "itl_ms_p99_by_concurrency": {c: level["itl_ms"]["p99"] for c, level in by_level.items()},
        "bandwidth_achieved_gbs": bandwidth,
        "ratios": {
            # Against the concurrency-1 level's aggregate throughput, so both sides include prefill and gaps.
            "throughput_16_over_1": _ratio(throughput.get("16"), base),
            "throughput_64_over_16": _ratio(throughput.get("64"), throughput.get("16")),
            "throughput_max_over_1": _ratio(max(throughput.values(), default=None), base),
        },
    }


def _fmt(value: float | None, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, int):
        return str(value)
    return f"{value:,.{digits}f}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(header[i]), *(len(r[i]) for r in rows)) for i in range(len(header))]
    line = "  ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(zip(header, widths, strict=True)))
    out = [line, "  ".join("-" * w for w in widths)]
    for r in rows:
        out.append("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))))
    return "\n".join(out)


def format_tables(result: dict[str, Any]) -> str:
    """The single-stream table (with the llama.cpp column when it ran) and the per-concurrency table."""
    peer = result.get("peer") or {}
    peer_ok = "single_stream_tok_s" in peer
    header = ["single stream", "tokenmill"] + (["llama.cpp"] if peer_ok else [])
    single = result["single_stream"]
    rows = [
        ["decode tok/s", _fmt(result["single_stream_tok_s"])],
        ["end-to-end tok/s (incl. prefill)", _fmt(result["single_stream_e2e_tok_s"])],
        ["TTFT p50 ms", _fmt(result["ttft_ms_p50"])],
        ["ITL p50 ms", _fmt(result["itl_ms_p50"], 2)],
        ["ITL p99 ms", _fmt(result["itl_ms_p99"], 2)],
        ["bandwidth achieved GB/s", _fmt(result["bandwidth_achieved_gbs"], 2)],
        ["memory copy bandwidth GB/s", _fmt(result["copy_bandwidth_gbs"], 2)],
        ["requests (failed)", f"{single['requests']} ({single['failed_requests']})"],
    ]
    if peer_ok:
        peer_bw = (
            result["model"]["weight_bytes"] * peer["single_stream_tok_s"] / 1e9
            if result["model"].get("weight_bytes") and peer["single_stream_tok_s"]
            else None
        )
        extra = [
            _fmt(peer["single_stream_tok_s"]),
            "-",
            _fmt(peer["ttft_ms"]["p50"]),
            _fmt(peer["itl_ms"]["p50"], 2),
            _fmt(peer["itl_ms"]["p99"], 2),
            _fmt(peer_bw, 2) + " (f32-equiv.)" if peer_bw else "-",
            "",
            f"{peer['requests']} (0)",
        ]
        rows = [r + [e] for r, e in zip(rows, extra, strict=True)]
    parts = [_table(header, rows)]

    level_header = [
        "concurrency",
        "requests",
        "failed",
        "tok/s",
        "per-stream tok/s",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "ITL p50 ms",
        "ITL p99 ms",
        "ITL max ms",
        "max running/waiting",
    ]
    level_rows = [
        [
            str(level["concurrency"]),
            str(level["requests"]),
            str(level["failed_requests"]),
            _fmt(level["throughput_tok_s"]),
            _fmt(level["per_stream_decode_tok_s"]),
            _fmt(level["ttft_ms"]["p50"]),
            _fmt(level["ttft_ms"]["p99"]),
            _fmt(level["itl_ms"]["p50"], 2),
            _fmt(level["itl_ms"]["p99"], 2),
            _fmt(level["itl_ms"]["max"], 2),
            f"{_fmt(level['engine_max_running'])}/{_fmt(level['engine_max_waiting'])}",
        ]
        for level in result["levels"]
    ]
    if level_rows:
        parts.append(_table(level_header, level_rows))

    ratios = result["ratios"]
    notes = []
    if ratios["throughput_16_over_1"] is not None:
        notes.append(f"throughput at 16 streams / single stream: {ratios['throughput_16_over_1']:.2f}x")
    if ratios["throughput_64_over_16"] is not None:
        notes.append(f"throughput at 64 streams / 16 streams: {ratios['throughput_64_over_16']:.2f}x")
    notes.append(f"failed requests: {result['failed_requests']}")
    if not peer_ok and peer.get("skipped"):
        notes.append(f"llama.cpp peer: skipped ({peer['skipped']})")
    notes.extend(f"warning: {w}" for w in result.get("warnings", []))
    errors = {msg: n for level in [single, *result["levels"]] for msg, n in level["errors"].items()}
    notes.extend(f"  error x{n}: {msg}" for msg, n in errors.items())
    parts.append("\n".join(notes))
    return "\n\n".join(parts)
