"""A checkpoint the server cannot serve as asked stops it with exit code 2 (as a bad flag does), its
reason on stderr and in one log line per worker, without a traceback."""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path

import pytest

from tests.server_process import SERVER, free_port
from tokenmill_bench import shaped


def _serve(model: Path, *args: str) -> subprocess.CompletedProcess[str]:
    command = [str(SERVER), "--model", str(model), "--port", str(free_port()), "--http-port", str(free_port())]
    return subprocess.run(
        [*command, "--log-format", "json", *args], check=False, capture_output=True, text=True, timeout=300
    )


def test_an_unsupported_architecture_exits_2_naming_it_and_the_supported_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A GGUF with a tokenizer the server process reads, of an architecture no family registers.
    tiny = shaped.Shape("bloom", 256, 1, 4, 2, 512, 49152, 10000.0, tied=True)
    monkeypatch.setitem(shaped.SHAPES, "tiny-bloom", dataclasses.replace(tiny))
    path = shaped.write_shaped_gguf("tiny-bloom", tmp_path / "bloom.gguf")
    result = _serve(path)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "tokenmill-server: error:" in result.stderr and "'bloom'" in result.stderr and "llama" in result.stderr
    refused = [
        json.loads(line) for line in result.stdout.splitlines() + result.stderr.splitlines() if "worker_start" in line
    ]
    assert refused and all(entry["event"] == "worker_start_refused" and "traceback" not in entry for entry in refused)


def test_a_context_longer_than_the_kv_pool_holds_exits_2_saying_what_to_raise(default_model_path: Path) -> None:
    # The embedded model's KV cache takes 45 KiB a token (float32 for the native kernels): 1 MiB holds 16 tokens.
    result = _serve(default_model_path, "--kv-cache-memory", "1MiB", "--max-model-len", "4096")
    assert result.returncode == 2, result.stderr[-2000:]
    assert "--max-model-len 4096 needs" in result.stderr and "raise --kv-cache-memory" in result.stderr


def test_a_kv_pool_larger_than_the_memory_available_exits_2_saying_what_to_lower(default_model_path: Path) -> None:
    """The pool's pages are mapped as its blocks are first used: one the machine cannot give would run out
    under load, so it is refused at start."""
    result = _serve(default_model_path, "--kv-cache-memory", "64TiB")
    assert result.returncode == 2, result.stderr[-2000:]
    assert (
        "--kv-cache-memory 65536.0 GiB is more than the" in result.stderr and "lower --kv-cache-memory" in result.stderr
    )
