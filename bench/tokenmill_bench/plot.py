"""Throughput and inter-token latency against concurrency, drawn from a results JSON (matplotlib, Agg)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def plot_results(results_path: Path, png_path: Path) -> Path:
    """Draws the PNG from a results file written by ``tokenmill-bench --json``."""
    return plot_result(json.loads(results_path.read_text()), png_path)


def plot_result(result: dict[str, Any], png_path: Path) -> Path:
    """Writes a two-panel PNG: aggregate tok/s, and ITL p50/p99 with TTFT p50, for each concurrency level."""
    import matplotlib.pyplot as plt

    fig = draw(result)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return png_path


def draw(result: dict[str, Any]) -> Any:
    """The figure (a matplotlib Figure): value labels inside their panel, above the lines, and the
    latency axis labelled in plain numbers, so no two labels overlap."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers; must precede pyplot
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    levels = sorted(result["levels"], key=lambda level: level["concurrency"])
    if not levels:
        raise ValueError("the results have no concurrency levels to plot")
    conc = [level["concurrency"] for level in levels]
    tok_s = [level["throughput_tok_s"] for level in levels]
    itl_p50 = [level["itl_ms"]["p50"] for level in levels]
    itl_p99 = [level["itl_ms"]["p99"] for level in levels]
    ttft_p50 = [level["ttft_ms"]["p50"] for level in levels]

    fig, (ax_tp, ax_lat) = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True)
    ax_tp.plot(conc, tok_s, marker="o", color="tab:blue", label="tokenmill aggregate")
    for x, y in zip(conc, tok_s, strict=True):
        ax_tp.annotate(
            f"{y:.0f}" if y >= 100 else f"{y:.1f}",
            (x, y),
            textcoords="offset points",
            xytext=(0, 6),
            ha="center",
            fontsize=8,
        )
    peer = result.get("peer") or {}
    if peer.get("levels"):
        peer_levels = sorted(peer["levels"], key=lambda level: level["concurrency"])
        ax_tp.plot(
            [level["concurrency"] for level in peer_levels],
            [level["throughput_tok_s"] for level in peer_levels],
            marker="o",
            color="tab:gray",
            linestyle="--",
            label=f"{peer['name']} aggregate",
        )
    ax_tp.set_xscale("log", base=2)
    ax_tp.set_xticks(conc, [str(c) for c in conc])
    ax_tp.set_xlabel("concurrent streams")
    ax_tp.set_ylabel("generated tokens / s")
    peak = max([*tok_s, *[level["throughput_tok_s"] for level in peer.get("levels") or []]])
    ax_tp.set_ylim(0, peak * 1.18 or 1.0)  # room above the highest point for its label
    ax_tp.set_title("Throughput")
    ax_tp.grid(True, alpha=0.3)
    ax_tp.legend(loc="best", fontsize=8)  # where it covers the fewest points

    ax_lat.plot(conc, itl_p99, marker="o", color="tab:red", label="inter-token p99")
    ax_lat.plot(conc, itl_p50, marker="o", color="tab:orange", linestyle="--", label="inter-token p50")
    ax_lat.plot(conc, ttft_p50, marker="s", color="tab:purple", linestyle=":", label="time to first token p50")
    ax_lat.set_xscale("log", base=2)
    ax_lat.set_xticks(conc, [str(c) for c in conc])
    ax_lat.set_yscale("log")
    # Plain numbers at 1, 2 and 5 of each decade: the log scale's own minor labels (6x10^1, 4x10^1, ...)
    # run into each other.
    ax_lat.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax_lat.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    ax_lat.yaxis.set_minor_formatter(NullFormatter())
    ax_lat.set_xlabel("concurrent streams")
    ax_lat.set_ylabel("ms")
    ax_lat.set_title("Latency")
    ax_lat.grid(True, which="both", alpha=0.3)
    ax_lat.legend(loc="best", fontsize=8)

    settings = result.get("settings", {})
    machine = result.get("machine", {})
    fig.suptitle(
        f"tokenmill, {result.get('model', {}).get('name', 'model')} {result.get('model', {}).get('dtype', '')}"
        f" on {machine.get('cores', '?')} cores ({machine.get('cpu_model', '?')}, {machine.get('device', '?')});"
        f" {settings.get('prompt_tokens', '?')}-token prompts, {settings.get('output_tokens', '?')} output tokens",
        fontsize=10,
    )
    return fig
