"""tokenmill-bench lora's parts: the adapters it writes are PEFT adapters the server accepts for the served
model (a Hugging Face directory's or a GGUF's dimensions), requests spread evenly over the adapters, and
the accounting of tokens per second, their ratio and the load times."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenmill_bench.load import RequestRecord
from tokenmill_bench.lora import (
    BaseDims,
    adapter_of,
    base_dims,
    build_parser,
    format_table,
    load_times,
    ratio,
    throughput,
    write_adapter,
)
from tokenmill_service.worker.layers.lora import read_adapter

CONFIG = {
    "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2,
}  # fmt: skip


class Dims:
    """The service's view of the same model (what read_adapter checks an adapter against)."""

    hidden_size, intermediate_size, num_layers, num_heads, num_kv_heads, head_dim = 64, 96, 2, 4, 2, 16


def test_the_defaults_measure_eight_rank_16_adapters_at_16_and_64_streams() -> None:
    args = build_parser().parse_args([])
    assert (args.adapters, args.rank, args.concurrency, args.load_trials) == (8, 16, "16,64", 5)


def test_the_written_adapter_is_one_the_server_accepts_for_the_model(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(CONFIG))
    dims = base_dims(tmp_path / "model")
    assert dims == BaseDims(64, 96, 2, 4, 2, 16)
    adapter = read_adapter("a", write_adapter(tmp_path / "a", dims, 16, seed=1), Dims(), max_rank=16)
    assert adapter.rank == 16 and adapter.scale == 2.0
    assert adapter.targets == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    assert len(adapter.modules) == 2 * 7
    a, b = adapter.tensors()["model.layers.1.self_attn.k_proj"]
    assert a.shape == (16, 64) and b.shape == (32, 16) and a.abs().sum() > 0 and b.abs().sum() > 0


def test_a_gguf_models_dimensions_come_from_its_metadata(tmp_path: Path) -> None:
    gguf = pytest.importorskip("gguf")
    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(96)
    writer.add_block_count(2)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert base_dims(tmp_path / "m.gguf") == BaseDims(64, 96, 2, 4, 2, 16)


def test_requests_spread_evenly_over_the_adapters() -> None:
    names = [f"lora{i}" for i in range(8)]
    used = [adapter_of(i, names) for i in range(64)]
    assert {n: used.count(n) for n in names} == dict.fromkeys(names, 8)
    assert adapter_of(5, []) == ""


def record(index: int, tokens: int, error: str | None = None) -> RequestRecord:
    return RequestRecord(index=index, sent=0.0, arrivals=[0.1] * tokens, counts=[1] * tokens, error=error)


def test_the_accounting_counts_finished_tokens_over_the_wall_time() -> None:
    base = throughput([record(i, 64) for i in range(16)], wall_s=4.0)
    assert (base["generated_tokens"], base["tokens_per_s"], base["failed"]) == (1024, 256.0, 0)
    lora = throughput([record(i, 64) for i in range(16)], wall_s=5.0)
    assert ratio(lora, base) == 0.8
    failing = throughput([record(0, 64), record(1, 3, "SHORT: 3 of 64 tokens")], wall_s=1.0)
    assert (failing["generated_tokens"], failing["failed"]) == (64, 1) and ratio(failing, base) is None
    assert load_times([0.02, 0.05, 0.03]) == {"trials": 3, "p50_ms": 30.0, "max_ms": 50.0}
    table = format_table(
        {"levels": [{"concurrency": 16, "base": base, "lora": lora, "ratio": 0.8}], "load": load_times([0.03])}
    ).splitlines()
    assert table[1].split() == ["16", "256.0", "204.8", "0.80", "0"]
    assert table[2] == "adapter load (/v1/load_lora_adapter): p50 30.0 ms, max 30.0 ms"
