"""tokenmill-bench: a tiny run against the shared live server, the plot command, and its pure helpers."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tokenmill_bench.load import RequestRecord, prompt_ids
from tokenmill_bench.report import format_tables
from tokenmill_bench.stats import percentile

BENCH = Path(sys.executable).parent / "tokenmill-bench"

REQUIRED_KEYS = (
    "single_stream_tok_s",
    "ttft_ms_p50",
    "itl_ms_p50",
    "itl_ms_p99",
    "throughput_tok_s",
    "bandwidth_achieved_gbs",
    "copy_bandwidth_gbs",
    "failed_requests",
    "machine",
    "levels",
    "settings",
)


def test_percentile_interpolates_like_numpy() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([float(i) for i in range(101)], 99) == pytest.approx(99.0)


def test_prompts_are_fixed_and_defeat_the_prefix_cache() -> None:
    a0, a1 = prompt_ids(32, 0, 49152), prompt_ids(32, 1, 49152)
    assert a0 == prompt_ids(32, 0, 49152)  # deterministic
    assert len(a0) == 32 and all(1000 <= t < 49152 for t in a0 + a1)
    assert a0[0] != a1[0] and a0[1:] == a1[1:]  # only the first token differs between requests
    assert prompt_ids(32, 0, 49152, shared=True) == prompt_ids(32, 7, 49152, shared=True)
    assert len({prompt_ids(4, i, 49152)[0] for i in range(500)}) == 500


def test_another_runs_prompts_share_no_prefix_with_these() -> None:
    # Regression: the levels' prompts were the same every run, so a llama-server kept from an earlier run
    # answered them from its slots' prompt cache (a 16-stream level's time to first token 245 ms, not 3.7 s).
    for seed in (1, 12345, 2**31 - 1):
        ours = [prompt_ids(32, i, 49152, seed=seed) for i in range(64)]
        assert ours == [prompt_ids(32, i, 49152, seed=seed) for i in range(64)]  # deterministic for a run
        assert len({p[0] for p in ours}) == 64 and all(p[1:] == ours[0][1:] for p in ours)
        earlier = [prompt_ids(32, i, 49152) for i in range(64)]
        assert all(a[1] != b[1] for a in ours for b in earlier)  # at most the first id in common


def test_inter_token_latency_splits_multi_token_messages() -> None:
    record = RequestRecord(index=0, sent=0.0, arrivals=[0.1, 0.2, 0.5], counts=[1, 1, 3])
    assert record.ttft_s == pytest.approx(0.1)
    assert record.inter_token_s() == pytest.approx([0.1, 0.1, 0.1, 0.1])
    assert record.decode_span() == (4, pytest.approx(0.4))


def test_bench_against_live_server(server_address: str, tmp_path: Path) -> None:
    results, png = tmp_path / "results.json", tmp_path / "plot.png"
    args = ["--server", server_address, "--concurrency", "1,2", "--output-tokens", "8", "--prompt-tokens", "8"]
    # One round per level and a small copy buffer keep it quick on a shared 2-core machine.
    args += ["--rounds", "1", "--min-requests", "1", "--warmup", "0", "--copy-buffer-mib", "32"]
    # Another process keeps a core busy while it measures a server it did not start (but which runs on
    # this machine, so its processes are known): the run says its numbers are pessimistic.
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        proc = subprocess.run(
            [str(BENCH), *args, "--json", str(results), "--quiet"],
            check=False,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        busy.kill()
        busy.wait()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "decode tok/s" in proc.stdout and "concurrency" in proc.stdout

    data = json.loads(results.read_text())
    for key in REQUIRED_KEYS:
        assert key in data, key
    assert data["failed_requests"] == 0
    assert set(data["throughput_tok_s"]) == {"1", "2"}
    assert all(v > 0 for v in data["throughput_tok_s"].values())
    assert data["single_stream_tok_s"] > 0 and data["ttft_ms_p50"] > 0 and data["itl_ms_p99"] >= data["itl_ms_p50"]
    assert data["copy_bandwidth_gbs"] > 0
    # The server's own count (GetModelInfo.weight_bytes): every matrix as the GGUF stores it (Q4_1, the
    # Q8_0 head), about 92 MiB.
    assert data["model"]["quantization"] == "gguf-vnni"
    assert 90e6 < data["model"]["weight_bytes"] < 100e6
    assert data["bandwidth_achieved_gbs"] == pytest.approx(
        data["model"]["weight_bytes"] * data["single_stream_tok_s"] / 1e9
    )
    # The read rate measured again right after the single stream, and the stream's share of it.
    assert data["read_bandwidth_beside_single_gbs"] > 0
    # ... with each probe's own figure, the best of which it is (a figure far off the others is then traceable).
    by_method = data["read_bandwidth_beside_single_by_method_gbs"]
    assert "numpy" in by_method and max(by_method.values()) == data["read_bandwidth_beside_single_gbs"]
    assert data["bandwidth_share_beside_single"] == pytest.approx(
        data["bandwidth_achieved_gbs"] / data["read_bandwidth_beside_single_gbs"]
    )
    for key in ("cores", "memory_bytes", "cpu_model", "torch_version", "device"):
        assert data["machine"][key], key
    for level in data["levels"]:
        assert level["failed_requests"] == 0
        assert level["generated_tokens"] == level["requests"] * 8
        assert all(row["tokens"] == 8 for row in level["per_request"])
    assert format_tables(data)  # the table re-renders from the stored JSON
    assert all(level["other_load_cores"] is not None for level in [data["single_stream"], *data["levels"]])
    for when in ("start", "end"):  # both cores' matrix product against one's, around the run
        probe = data["machine"]["core_scaling"][when]
        assert probe["speedup"] == pytest.approx(probe["one_thread_s"] / probe["all_threads_s"]), probe
        assert all(p["pid"] > 0 and p["cores"] > 0 for p in probe["busy_beside"]), probe
    assert any("other processes kept" in w for w in data["warnings"]), data["warnings"]

    proc = subprocess.run(
        [str(BENCH), "plot", str(results), str(png)], check=False, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_memory_rate_is_measured_on_a_buffer_past_the_last_level_cache() -> None:
    """A buffer that fits the CPU's last-level cache (an Intel Xeon VM reports 480 MiB of L3) measures the cache's
    rate, not memory's: the read and copy buffers are at least twice the cache, and 256 MiB where it is smaller."""
    from tokenmill_bench.machine import COPY_BUFFER_BYTES, buffer_bytes, last_level_cache_bytes

    cache = last_level_cache_bytes()
    assert cache is None or cache >= 32 * 2**10  # an L1 at least, read as bytes
    assert buffer_bytes() == max(COPY_BUFFER_BYTES, 2 * (cache or 0))


def test_a_slow_core_around_the_run_is_a_warning() -> None:
    """Threads that together compute little faster than one (a core held by something else, as a virtual
    machine's neighbour can) make the run's figures low: said, at the start or the end, and not otherwise."""
    from tokenmill_bench.results import run_warnings

    def result(start: float, end: float) -> dict[str, Any]:
        probes = {w: {"threads": 2, "one_thread_s": 1.0, "all_threads_s": 1 / s, "speedup": s} for w, s in
                  (("start", start), ("end", end))}  # fmt: skip
        return {"single_stream": {"concurrency": 1}, "levels": [], "model": {}, "server": {},
                "machine": {"cores": 2, "core_scaling": probes}}  # fmt: skip

    assert run_warnings(result(1.9, 1.8)) == []
    (warning,) = run_warnings(result(1.05, 1.9))
    assert warning.startswith("at the run's start, 2 threads multiplied a matrix only 1.05 times as fast as one")
    assert "busy beside it" not in warning
    assert [w.split(",")[0] for w in run_warnings(result(1.2, 1.1))] == ["at the run's start", "at the run's end"]
    held = result(1.9, 0.16)
    held["machine"]["core_scaling"]["end"]["busy_beside"] = [{"pid": 4242, "name": "spinner", "cores": 0.93}]
    (warning,) = run_warnings(held)
    assert warning.endswith("; busy beside it: spinner (pid 4242) 0.93 cores"), warning


def test_the_process_that_holds_a_core_beside_the_threads_product_is_named() -> None:
    """A process spinning on a core while the threads multiply (what made the probe at some runs' end 0.16 times
    as fast as one thread) is among the busiest other processes the probe names, with about a core."""
    from tokenmill_bench.machine import core_scaling

    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)  # started and spinning
        probe = core_scaling()
    finally:
        spinner.kill()
        spinner.wait()
    assert probe is not None
    named = {p["pid"]: p for p in probe["busy_beside"]}
    assert spinner.pid in named, probe
    assert named[spinner.pid]["cores"] > 0.3, probe


def test_cpu_peak_compiles_and_prints_the_rates(tmp_path: Path) -> None:
    """bench/kernels/cpu_peak.cpp, which history.md's arithmetic ceiling quotes, still builds and runs: AVX2's
    rates on any x86 CPU with AVX2, AVX-VNNI's and AVX-512's too where the CPU has them."""
    from tokenmill_service.contract.plan import cpu_isa

    if shutil.which("g++") is None or cpu_isa.missing("avx2") is not None:
        pytest.skip("needs g++ and an x86 CPU with AVX2")
    source = Path(__file__).resolve().parents[2] / "bench" / "kernels" / "cpu_peak.cpp"
    binary = tmp_path / "cpu_peak"
    subprocess.run(["g++", "-O2", "-march=native", str(source), "-o", str(binary)], check=True, timeout=120)
    out = subprocess.run([str(binary)], capture_output=True, text=True, check=True, timeout=180).stdout
    rates = dict(re.findall(r"^(\S+ \S+)\s+([\d.]+) G multiply-adds/s", out, re.MULTILINE))
    expected = {"float32 vfmadd231ps-ymm", "int8 vpmaddubsw-ymm", "int16 vpmaddwd-ymm"}
    if "avx_vnni" in cpu_isa.cpu_flags():
        expected |= {"int8 vpdpbusd-ymm", "int16 vpdpwssd-ymm"}
    if {"avx512_vnni", "avx512_bf16"} <= cpu_isa.cpu_flags():
        expected |= {"float32 vfmadd231ps", "int8 vpdpbusd", "int16 vpdpwssd", "bf16 vdpbf16ps"}
    assert set(rates) == expected, out
    assert all(float(rate) > 0 for rate in rates.values()), out


def test_pipe_sharing_compiles_and_prints_each_products_rate_beside_the_folds_instructions(tmp_path: Path) -> None:
    """bench/kernels/pipe_sharing.cpp, which bench/README.md quotes for the ceiling a k-quant tile's instruction
    mix leaves, still builds and runs: AVX2's byte product on any x86 CPU with AVX2, AVX-512 VNNI's two where
    the CPU has them; each with the product alone and its rate beside FMAs, shifts and converts."""
    from tokenmill_service.contract.plan import cpu_isa

    if shutil.which("g++") is None or cpu_isa.missing("avx2") is not None:
        pytest.skip("needs g++ and an x86 CPU with AVX2")
    source = Path(__file__).resolve().parents[2] / "bench" / "kernels" / "pipe_sharing.cpp"
    binary = tmp_path / "pipe_sharing"
    subprocess.run(["g++", "-O2", "-march=native", str(source), "-o", str(binary)], check=True, timeout=120)
    out = subprocess.run([str(binary), "2000000"], capture_output=True, text=True, check=True, timeout=120).stdout
    alone = dict(re.findall(r"^(\S+).*: ([\d.]+) G a second alone$", out, re.MULTILINE))
    expected = {"vpmaddubsw-ymm"}
    if "avx512_vnni" in cpu_isa.cpu_flags():
        expected |= {"vpdpbusd", "vpdpwssd"}
    assert set(alone) == expected, out
    assert all(float(rate) > 0 for rate in alone.values()), out
    shares = re.findall(r"^  \+ (\d+) (FMAs|shift\+and|converts) a 24\s+([\d.]+)", out, re.MULTILINE)
    assert len(shares) == 3 * len(expected), out
    assert all(0 < float(share) < 2 for _, _, share in shares), out


def test_read_with_arithmetic_compiles_and_prints_a_rate_for_each_amount_of_arithmetic(tmp_path: Path) -> None:
    """bench/kernels/read_with_arithmetic.cpp, which history.md quotes for what share of the read rate a kernel
    of so much arithmetic a byte can reach, still builds and runs (AVX2's products on any x86 CPU with AVX2,
    AVX-512 VNNI's where the CPU has them)."""
    from tokenmill_service.contract.plan import cpu_isa

    if shutil.which("g++") is None or cpu_isa.missing("avx2") is not None:
        pytest.skip("needs g++ and an x86 CPU with AVX2")
    source = Path(__file__).resolve().parents[2] / "bench" / "kernels" / "read_with_arithmetic.cpp"
    binary = tmp_path / "read_with_arithmetic"
    cmd = ["g++", "-O3", "-march=native", "-fopenmp", str(source), "-o", str(binary)]
    subprocess.run(cmd, check=True, timeout=120)
    out = subprocess.run([str(binary), "64", "2"], capture_output=True, text=True, check=True, timeout=120).stdout
    rows = re.findall(r"^W=(\d+)\s+in L2\s+([\d.]+) GB/s a core\s+from memory\s+([\d.]+) GB/s", out, re.MULTILINE)
    assert [int(w) for w, _, _ in rows] == [0, 2, 4, 8, 12, 16], out
    assert all(float(cached) > 0 and float(memory) > 0 for _, cached, memory in rows), out
    product = "vpdpbusd-zmm" if {"avx512_vnni", "avx512bw"} <= cpu_isa.cpu_flags() else "vpmaddubsw-ymm"
    assert f"a 64 MiB buffer, 2 threads, {product}" in out, out


def run_kernel_bench(script: str, kernel: str | None, *args: str, needs_git: bool = True) -> str:
    """Runs bench/kernels/SCRIPT with ARGS and returns what it printed;
    skips where the native ``kernel`` (None: none) cannot be built, or (``needs_git``: the script reads a
    revision's source) outside the git checkout."""
    from tokenmill_service.worker.kernels.cpu import build

    if kernel is not None and (shutil.which("g++") is None or build.unavailable_reason(kernel) is not None):
        pytest.skip(f"needs g++ and a CPU {kernel} runs on")
    root = Path(__file__).resolve().parents[2]
    git = (
        subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, check=False) if needs_git else None
    )
    if git is not None and git.returncode:
        pytest.skip("needs the git checkout")
    proc = subprocess.run(
        [sys.executable, str(root / "bench" / "kernels" / script), *args],
        capture_output=True, text=True, check=False, timeout=300, cwd=root,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.slow
def test_the_quantized_gemm_bench_finds_a_revisions_kernel_bit_for_bit_the_same() -> None:
    """bench/kernels/quantized_gemm_speed.py, which compares the quantized products with an earlier
    revision's, still builds that revision's kernel, checks it (here against HEAD's own source) and times
    both on weights read from memory; here the 8-bit activations' products (--int8, the same script but for
    the entry point's name, so one build serves both). For this CPU's own instruction set: the revision's kernel
    is the working tree's, so both are the build the suite made at its start (built in the kernel cache by
    content), not a build of their own (half a minute for AVX-512's k-quants)."""
    from tokenmill_service.contract.plan import cpu_isa

    out = run_kernel_bench(
        "quantized_gemm_speed.py", "kquant_gemm", "--old-rev", "HEAD", "--old-isa", cpu_isa.selected(), "--formats",
        "Q6_K", "--int8", "--m", "1,16", "--shapes", "256x64", "--repeats", "4", "--from-memory", "4",
    )  # fmt: skip
    assert "packing same" in out and "bitwise identical" in out, out
    # --from-memory: each call reads the next copy of the weight; the new kernel's read rate and multiply-adds
    # a second are printed.
    header, *rows = out.strip().splitlines()[-3:]
    assert header.split()[-4:] == ["new", "GB/s", "new", "GMAC/s"], out
    assert all(float(row.split()[-2]) > 0 and float(row.split()[-1]) > 0 for row in rows), out


def test_the_prefill_profile_splits_a_prompts_time_between_the_stacks_parts() -> None:
    """bench/kernels/prefill_profile.py on the embedded model: one prompt's wall time beside the native stack's
    products, attention, the rest of the stack and what is outside it, each in milliseconds."""
    from tokenmill_service.contract.model_paths import resolve_model_path

    out = run_kernel_bench(
        "prefill_profile.py", "decoder_stack", "--model", str(resolve_model_path(None)), "--tokens", "64",
        "--runs", "1", needs_git=False,
    )  # fmt: skip
    header, row = out.strip().splitlines()[-2:]
    assert header.split() == ["wall", "products", "attention", "stack", "rest", "outside"], out
    wall, products, attention, rest, outside = (float(v) for v in row.split())
    assert 0 < products < wall and attention >= 0 and rest >= 0, out
    assert abs(products + attention + rest + outside - wall) <= 2, out  # the parts add up (each rounded to 1 ms)


@pytest.mark.slow
def test_the_kquant_tiles_bench_holds_another_tile_to_the_defaults_bits() -> None:
    """bench/kernels/kquant_tiles.py builds kquant_gemm.cpp with other tile sizes (-D overrides) and checks
    each variant's outputs against the default build's, bit for bit, before it prints their rates. For this
    CPU's own instruction set, whose default build the suite made at its start (another's may still be building
    in the background)."""
    from tokenmill_service.contract.plan import cpu_isa

    isa = cpu_isa.selected()
    if isa not in ("avx2", "avx2vnni", "avx512"):
        pytest.skip("needs an x86 CPU with AVX2")
    tile = "-DKQUANT_MT=3 -DKQUANT_NG=1 -DKQUANT_MT_DIGITS=2 -DKQUANT_DIGIT_ROWS=0"
    out = run_kernel_bench(
        "kquant_tiles.py", "kquant_gemm", "--isa", isa, "--variant=", f"--variant={tile}", "--formats", "Q4_K",
        "--shapes", "256x64", "--m", "8", "--threads", "1", "--repeats", "2", needs_git=False,
    )  # fmt: skip
    assert f"v1: {tile}" in out and out.strip().endswith("bitwise identical"), out
    row = out.strip().splitlines()[-2].split()
    assert row[:5] == ["Q4_K", "256", "64", "8", "1"] and float(row[5]) > 0 and float(row[7]) > 0, out


def test_the_prefill_peak_counts_a_prompts_multiply_adds_and_picks_the_products_instruction() -> None:
    """bench/prefill_peak.py's arithmetic, on the embedded model (SmolLM2-135M: 30 layers, hidden 576,
    9 heads of 64, 3 key-value heads, MLP 1536, vocabulary 49152)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import prefill_peak

    from tokenmill_service.contract.model_paths import resolve_model_path

    shape = prefill_peak.model_shape(resolve_model_path(None))
    per_layer = 576 * 576 * 2 + 576 * 192 * 2 + 576 * 1536 * 3  # q, o; k, v; gate, up, down
    assert shape == {"layers_macs": 30 * per_layer, "output_macs": 49152 * 576, "attention_width": 30 * 576}
    assert prefill_peak.prompt_macs(shape, 4) == 4 * 30 * per_layer + 30 * 576 * 4 * 5 + 49152 * 576
    peaks = {"int8 vpdpbusd": 1.0, "int8 vpmaddubsw-ymm": 1.0}
    assert prefill_peak.peak_name(["--activations=int8"], peaks) == "int8 vpdpbusd"
    assert prefill_peak.peak_name(["--activations=int8", "--cpu-isa=avx2"], peaks) == "int8 vpmaddubsw-ymm"
    assert prefill_peak.peak_name([], peaks) == "int16 vpdpwssd"
    assert prefill_peak.peak_name(["--activations=int8", "--cpu-isa=avx2vnni"], peaks) == "int8 vpdpbusd-ymm"
    assert prefill_peak.peak_name(["--cpu-isa=avx2vnni"], peaks) == "int16 vpdpwssd-ymm"
    assert prefill_peak.peak_name([], {"int8 vpmaddubsw-ymm": 1.0}) == "int16 vpmaddwd-ymm"


@pytest.mark.slow
def test_the_attention_bench_times_a_kernel_against_another_and_checks_their_bits() -> None:
    """bench/kernels/attention_speed.py times decode attention against a revision's; here the working
    tree's own ('.'), as building a revision's kernel is the quantized bench test's part."""
    out = run_kernel_bench(
        "attention_speed.py", "paged_attention", "--old-rev", ".", "--context", "100", "--layers", "2",
        "--repeats", "2", needs_git=False,
    )  # fmt: skip
    assert "bitwise identical" in out and "new / old:" in out, out


def test_the_sampling_bench_times_a_revisions_sampler_beside_the_working_trees() -> None:
    """bench/kernels/sampling_speed.py imports HEAD's sampler beside the working tree's and prints both
    times for every shape of logits and way of sampling."""
    out = run_kernel_bench(
        "sampling_speed.py", None, "--old-rev", "HEAD", "--vocab", "1000", "--batch", "2", "--repeats", "2",
    )  # fmt: skip
    rows = [line.split() for line in out.strip().splitlines()[1:]]
    assert len(rows) == 3 * 4, out  # peaked, broad, flat; greedy and three ways of sampling
    assert all(float(row[-1]) > 0 for row in rows), out


def test_a_started_server_takes_free_ports_beside_one_on_8000_and_keeps_its_log(tmp_path: Path) -> None:
    """`make run` holds 8000 for HTTP; the benchmark's own server must not need it."""
    import socket
    import urllib.request

    from tokenmill_bench.server import ManagedServer

    squatter = socket.socket()
    try:
        squatter.bind(("127.0.0.1", 8000))
        squatter.listen()
    except OSError:
        pass  # already taken (a developer's server): the case itself
    log_path = tmp_path / "server.log"
    server = ManagedServer(["--drain-seconds", "1"], log_path)
    try:
        assert server.http_port not in (None, 8000)
        server.start()
        with urllib.request.urlopen(f"http://127.0.0.1:{server.http_port}/health", timeout=10) as reply:
            assert reply.status == 200
    finally:
        server.close()
        squatter.close()
    assert server.log_path == str(log_path)
    assert '"server_listening"' in log_path.read_text()  # kept after the run, where it said
    kept = ManagedServer(["--http-port", "0"])
    try:
        assert kept.http_port is None and kept.args[-2:] == ["--http-port", "0"]
    finally:
        kept.close()
    assert Path(kept.log_path).exists()
    Path(kept.log_path).unlink()


def test_bench_constrains_every_request_with_json_schema(server_address: str, tmp_path: Path) -> None:
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}}))
    results = tmp_path / "results.json"
    args = ["--server", server_address, "--concurrency", "2", "--output-tokens", "8", "--prompt-tokens", "8"]
    args += ["--rounds", "1", "--min-requests", "1", "--warmup", "0", "--copy-buffer-mib", "32"]
    proc = subprocess.run(
        [str(BENCH), *args, "--json-schema", str(schema), "--json", str(results), "--quiet"],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(results.read_text())
    assert data["failed_requests"] == 0 and data["throughput_tok_s"]["2"] > 0
    assert '"constraint": {"json_schema": ' in json.dumps(data)


@pytest.mark.parametrize("name", ["results.json", "results-peer.json"])
def test_the_plots_labels_do_not_overlap(name: str) -> None:
    """Value labels, tick labels, titles and legends of each panel: no two boxes cross, and every value
    label is inside its panel."""
    import matplotlib.pyplot as plt

    from tokenmill_bench.plot import draw

    fig = draw(json.loads((Path(__file__).parents[2] / "bench" / "results" / name).read_text()))
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        for ax in fig.axes:
            labels = [t for t in [*ax.get_xticklabels(), *ax.get_yticklabels()] if t.get_visible() and t.get_text()]
            boxes = [t.get_window_extent(renderer) for t in [*labels, *ax.texts, ax.title]]
            legend = ax.get_legend()
            if legend is not None:
                boxes.append(legend.get_window_extent(renderer))
            for i, a in enumerate(boxes):
                for b in boxes[i + 1 :]:
                    assert not a.overlaps(b), (ax.get_title(), a, b)
            inside = ax.get_window_extent(renderer)
            for text in ax.texts:
                box = text.get_window_extent(renderer)
                assert inside.x0 <= box.x0 and box.x1 <= inside.x1 and inside.y0 <= box.y0 and box.y1 <= inside.y1
    finally:
        plt.close(fig)


def test_one_row_pass_compiles_and_prints_the_rates(tmp_path: Path) -> None:
    """bench/kernels/one_row_pass.cpp, which history.md quotes for what one decoding row's products read against
    a plain read and a bare loop, still builds and runs against the kernel library (AVX-512 VNNI only)."""
    from tokenmill_service.contract.plan import cpu_isa
    from tokenmill_service.worker.kernels.cpu import build

    if shutil.which("g++") is None or cpu_isa.missing("avx512") is not None:
        pytest.skip("needs g++ and a CPU with AVX-512 VNNI")
    source = Path(__file__).resolve().parents[2] / "bench" / "kernels" / "one_row_pass.cpp"
    binary = tmp_path / "one_row_pass"
    cmd = ["g++", "-O2", "-march=native", "-fopenmp", str(source), "-o", str(binary), "-ldl"]
    subprocess.run(cmd, check=True, timeout=120)
    library = str(build.built("kquant_gemm", "avx512"))
    out = subprocess.run([str(binary), "2", "1", library], capture_output=True, text=True, check=True, timeout=120)
    rates = re.findall(r"^  (.+?)\s+([\d.]+) GB/s", out.stdout, re.MULTILINE)
    assert [name for name, _ in rates] == ["plain read", library, "bare loop"], out.stdout
    assert all(float(rate) > 0 for _, rate in rates), out.stdout
