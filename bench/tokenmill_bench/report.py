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
    """The single-stream table, the per-concurrency table and, when a peer ran, the side-by-side tables."""
    single = result["single_stream"]
    rows = [
        ["decode tok/s", _fmt(result["single_stream_tok_s"])],
        ["end-to-end tok/s (incl. prefill)", _fmt(result["single_stream_e2e_tok_s"])],
        ["TTFT p50 ms", _fmt(result["ttft_ms_p50"])],
        ["ITL p50 ms", _fmt(result["itl_ms_p50"], 2)],
        ["ITL p99 ms", _fmt(result["itl_ms_p99"], 2)],
        ["bandwidth achieved GB/s", _fmt(result["bandwidth_achieved_gbs"], 2)],
        ["speculative drafts kept", _percent(single.get("draft_acceptance"), single.get("draft_tokens_proposed"))],
        ["memory read bandwidth GB/s", _fmt(result.get("read_bandwidth_gbs"), 2)],
        ["  read right after the single stream", _fmt(result.get("read_bandwidth_beside_single_gbs"), 2)],
        ["  bandwidth achieved, share of that", _percent_of(result.get("bandwidth_share_beside_single"))],
        ["memory copy bandwidth GB/s", _fmt(result["copy_bandwidth_gbs"], 2)],
        ["requests (failed)", f"{single['requests']} ({single['failed_requests']})"],
    ]
    parts = [_table(["single stream", "tokenmill"], rows)]

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
        "drafts kept",
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
            _percent(level.get("draft_acceptance"), level.get("draft_tokens_proposed")),
        ]
        for level in result["levels"]
    ]
    if level_rows:
        parts.append(_table(level_header, level_rows))
    if result.get("comparison"):
        parts.append(format_comparison(result))

    ratios = result["ratios"]
    notes = []
    if ratios["throughput_16_over_1"] is not None:
        notes.append(f"throughput at 16 streams / single stream: {ratios['throughput_16_over_1']:.2f}x")
    if ratios["throughput_64_over_16"] is not None:
        notes.append(f"throughput at 64 streams / 16 streams: {ratios['throughput_64_over_16']:.2f}x")
    notes.append(f"failed requests: {result['failed_requests']}")
    peer = result.get("peer") or {}
    if peer.get("skipped"):  # results written before the llama-server peer
        notes.append(f"peer: skipped ({peer['skipped']})")
    notes.extend(f"warning: {w}" for w in result.get("warnings", []))
    errors = {msg: n for level in [single, *result["levels"]] for msg, n in level["errors"].items()}
    notes.extend(f"  error x{n}: {msg}" for msg, n in errors.items())
    parts.append("\n".join(notes))
    return "\n\n".join(parts)


def _percent(share: float | None, of: int | None) -> str:
    """``kept/checked (share)``, or "-" where no draft was checked (speculation off or idle)."""
    if share is None or not of:
        return "-"
    return f"{round(share * of)}/{of} ({share:.0%})"


def _percent_of(share: float | None) -> str:
    return f"{share:.0%}" if share is not None else "-"


def _ratio_cell(value: float | None) -> str:
    return f"{value:.2f}x" if value is not None else "-"


def format_comparison(result: dict[str, Any]) -> str:
    """tokenmill beside the peer: each level's figures and ratio, the long prompts, the first request."""
    from tokenmill_bench.comparison import METRICS

    comparison = result["comparison"]
    peer = comparison["peer"]
    weights = comparison["weight_bytes"]
    read_gbs = comparison["read_bandwidth_gbs"]
    rows = []
    for level in comparison["levels"]:
        for i, (key, label, digits) in enumerate(METRICS):
            ours, theirs = level["tokenmill"][key], level["peer"][key]
            if key == "bandwidth_share":
                cells = [f"{ours:.0%}" if ours is not None else "-", f"{theirs:.0%}" if theirs is not None else "-"]
            else:
                cells = [_fmt(ours, digits), _fmt(theirs, digits)]
            streams = f"{level['concurrency']}" if i == 0 else ""
            rows.append([streams, label, *cells, _ratio_cell(level["ratio"][key])])
    header = ["streams", "metric", "tokenmill", peer, "tokenmill/" + peer]
    title = (
        f"tokenmill vs {peer}, same requests, alternately (one stream: a request each in turn; more: a level "
        f"each in turn) (ratio = tokenmill / {peer}; "
        "above 1 is better for tok/s and bandwidth, below 1 for latencies)"
    )
    convention = (
        f"bandwidth = weight bytes read per step x steps/s (steps/s = per-stream decode tok/s); weight bytes: "
        f"tokenmill {_fmt_bytes(weights['tokenmill'])}, {peer} {_fmt_bytes(weights['peer'])}; "
        f"measured read bandwidth {_fmt(read_gbs, 2)} GB/s; where tokenmill keeps speculative drafts (the "
        "'drafts kept' column) several tokens share a step, so its figure is effective, not bytes actually read"
    )
    beside = comparison.get("single_stream_beside")
    if beside is not None:
        convention += (
            f"; one stream against the read rate measured right after it: tokenmill "
            f"{_percent_of(beside['tokenmill']['share'])} of {_fmt(beside['tokenmill']['read_gbs'], 2)} GB/s, {peer} "
            f"{_percent_of(beside['peer']['share'])} of {_fmt(beside['peer']['read_gbs'], 2)} GB/s"
        )
    lines = [title, convention, _table(header, rows)]
    failed = [
        f"{level['concurrency']} streams: {n} failed on {side}"
        for level in comparison["levels"]
        for side, n in level["failed"].items()
        if n
    ]
    lines.extend(f"warning: {text}" for text in failed)
    lines += _long_prompt_lines(comparison["long_prompts"], peer)
    lines += _first_request_lines(comparison["first_request"], peer)
    return "\n".join(lines)


def _long_prompt_lines(long: dict[str, Any], peer: str) -> list[str]:
    """The long prompts' time to first token on each side, and how it grows with the length."""
    if not long["rows"]:
        return []
    long_rows = [
        [
            f"{row['prompt_tokens']} tokens",
            _fmt(row["tokenmill_ttft_ms"]),
            _fmt(row["peer_ttft_ms"]),
            _ratio_cell(row["ratio"]),
        ]
        for row in long["rows"]
    ]
    if growth := long["growth"]:
        long_rows.append(
            [
                f"{growth['to_tokens']} / {growth['from_tokens']} (linear: {growth['length_ratio']:.1f}x)",
                _ratio_cell(growth["tokenmill"]),
                _ratio_cell(growth["peer"]),
                "",
            ]
        )
    tries = max(row.get("tries", 1) for row in long["rows"])
    what = "long prompt, max_new_tokens 1" + (f" (median of {tries})" if tries > 1 else "")
    long_header = [what, "tokenmill TTFT ms", f"{peer} TTFT ms", "tokenmill/" + peer]
    lines = ["", _table(long_header, long_rows)]
    return lines + [f"warning: long prompt: {e}" for row in long["rows"] for e in row["errors"]]


def _first_request_lines(first: dict[str, Any], peer: str) -> list[str]:
    """The cold first request beside the steady state, on each side."""
    first_rows = []
    for label, key, digits in (
        ("first request TTFT ms", "first_ttft_ms", 1),
        ("steady TTFT p50 ms (1 stream)", "steady_ttft_ms_p50", 1),
        ("first request total ms", "first_total_ms", 0),
        ("steady total p50 ms (1 stream)", "steady_total_ms_p50", 0),
    ):
        first_rows.append([label, _fmt(first["tokenmill"][key], digits), _fmt(first["peer"][key], digits)])
    return ["", _table(["cold vs warm", "tokenmill", peer], first_rows)]


def _fmt_bytes(value: int | None) -> str:
    return f"{value / 1e6:,.1f} MB" if value else "unknown"
