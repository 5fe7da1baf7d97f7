"""bench/RESULTS.md is the table `tokenmill-bench results` makes from bench/results/*.json, row for row."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tokenmill_bench.cli import main as bench_main
from tokenmill_bench.results_table import render, results_main

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"


def test_the_committed_results_md_is_what_the_results_files_give() -> None:
    assert (ROOT / "bench" / "RESULTS.md").read_text() == render(RESULTS), (
        "bench/RESULTS.md is stale: run `tokenmill-bench results` from the repository's root"
    )


def test_every_results_file_is_a_row_or_listed_with_what_it_holds() -> None:
    text = render(RESULTS)
    compared = [p for p in RESULTS.glob("*.json") if "comparison" in json.loads(p.read_text())]
    assert len(compared) > 20
    for path in RESULTS.glob("*.json"):
        assert text.count(f"[`{path.name}`](results/{path.name})") == 1, path.name
    # The embedded model's run of 2026-11-23 against llama-server, as its file says.
    row = next(line for line in text.splitlines() if line.startswith("| [`results-peer.json`]"))
    assert "| 3.61× | 3.33× | 8.53× |" in row and "1,000: 0.23×, 4,000: 0.26×" in row and "2026-11-23 18:56" in row


def test_a_new_results_file_makes_the_table_stale_until_it_is_regenerated(tmp_path: Path) -> None:
    results = tmp_path / "results"
    shutil.copytree(RESULTS, results)
    out = tmp_path / "RESULTS.md"
    assert bench_main(["results", "--results-dir", str(results), "--out", str(out)]) == 0
    assert results_main(["--results-dir", str(results), "--out", str(out), "--check"]) == 0
    newer = json.loads((results / "results-peer.json").read_text())
    newer["timestamp"] = "2030-01-02T03:04:05+00:00"
    newer["server"]["args"] = ["--model", "/somewhere/model.gguf", "--cpu-isa=avx2", "--workers", "2"]
    (results / "results-peer-2030.json").write_text(json.dumps(newer))
    assert results_main(["--results-dir", str(results), "--out", str(out), "--check"]) == 1
    assert results_main(["--results-dir", str(results), "--out", str(out)]) == 0
    table = out.read_text().split("## Against a peer server", 1)[1].split("## Not in the table", 1)[0]
    last = [line for line in table.splitlines() if line.startswith("| [`")][-1]  # rows by date: the newest last
    assert last.startswith("| [`results-peer-2030.json`]") and "| avx2 | `--workers 2` |" in last, last
    assert "/somewhere" not in out.read_text()  # the model's path is the machine's, not the run's
