"""LoRA adapters on the linear layers: PEFT adapters (ranks 8 and 64, rsLoRA) on a tiny random Llama give
transformers + PEFT's prompt logprobs within 1e-4 at float32 dense, the merged weights' logits, a
sequence's bits whatever adapters its neighbours use, the grouped product as its per-token definition,
two tensor-parallel ranks' shards making up the whole, a GGUF LoRA file (llama.cpp's layout) giving its PEFT
adapter's logits, and adapters that do not fit refused by name.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.lora_adapters import make_adapter, peft_model, tiny_llama
from tokenmill_service.contract.plan.options import LoadOptions
from tokenmill_service.worker.distributed.parallel import TensorParallel
from tokenmill_service.worker.engine.model_runner import ModelRunner, StepPlan
from tokenmill_service.worker.kernels import LoRAStack
from tokenmill_service.worker.layers.lora import AdapterError, attach_lora, read_adapter
from tokenmill_service.worker.layers.lora.sgmv import lora_delta, lora_delta_reference
from tokenmill_service.worker.loader import load, load_model

PROMPT = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(3)).tolist()


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    directory = tmp_path_factory.mktemp("tiny-llama")
    return directory, tiny_llama(directory)


@pytest.fixture(scope="module")
def adapters(base: tuple[Path, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Five adapters: ranks 8 and 64 (rsLoRA) on every projection, and three on some of them."""
    _, hf = base
    root = tmp_path_factory.mktemp("adapters")
    return {
        "r8": make_adapter(hf, root / "r8", 8, seed=10),
        "r64": make_adapter(hf, root / "r64", 64, seed=11, rslora=True),
        "qv": make_adapter(hf, root / "qv", 4, seed=12, targets=["q_proj", "v_proj"]),
        "mlp": make_adapter(hf, root / "mlp", 16, seed=13, targets=["gate_proj", "down_proj"]),
        "o": make_adapter(hf, root / "o", 2, seed=14, targets=["o_proj", "up_proj", "k_proj"]),
    }


@pytest.fixture(scope="module")
def model(base: tuple[Path, Any]) -> Any:
    return load_model(base[0], max_loras=6, max_lora_rank=64)


@pytest.fixture(scope="module")
def bf16_model(base: tuple[Path, Any]) -> Any:
    """The float32 dense model with bfloat16 adapter slots, as the default configuration stores them."""
    model = load_model(base[0], max_loras=6, max_lora_rank=64)
    attach_lora(model, 6, 64, torch.bfloat16)
    return model


def run_prompt(runner: ModelRunner, ids: list[int], slot: int, table: list[int]) -> torch.Tensor:
    """Logits of every position of ``ids`` run as one prefill under adapter ``slot``."""
    n = len(ids)
    _, (logits,) = runner.execute(StepPlan(ids, [n], [0], [table], [n - 1], [(0, n)], adapter_slots=[slot]))
    return logits


@pytest.mark.parametrize("name", ["r8", "r64"])
def test_prompt_logprobs_are_transformers_plus_peft(
    model: Any, base: tuple[Path, Any], adapters: dict[str, Path], name: str
) -> None:
    assert model.plan.executor.value == "native-stack" and "lora" in model.plan.summary()
    model.lora.load(0, name, str(adapters[name]))
    runner = ModelRunner(model, block_size=16, num_blocks=8)
    ours = torch.log_softmax(run_prompt(runner, PROMPT, 0, [0, 1, 2]), -1)
    with torch.inference_mode():
        theirs = torch.log_softmax(peft_model(base[1], adapters[name])(torch.tensor([PROMPT])).logits[0], -1)
        plain = torch.log_softmax(base[1](torch.tensor([PROMPT])).logits[0], -1)
    assert (theirs - plain).abs().max() > 0.05  # the adapter changes the model measurably
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    # The base alone, in the same runner: the slots leave it untouched.
    base_logits = torch.log_softmax(run_prompt(runner, PROMPT, -1, [3, 4, 5]), -1)
    torch.testing.assert_close(base_logits, plain, atol=1e-4, rtol=0)


def test_the_adapter_gives_the_merged_weights_logits(
    model: Any, base: tuple[Path, Any], adapters: dict[str, Path], tmp_path: Path
) -> None:
    merged = peft_model(base[1], adapters["r64"]).merge_and_unload()
    merged.save_pretrained(tmp_path, safe_serialization=True)
    merged_model = load_model(tmp_path)
    runner = ModelRunner(merged_model, block_size=16, num_blocks=8)
    expected = run_prompt(runner, PROMPT, -1, [0, 1, 2])
    model.lora.load(1, "r64", str(adapters["r64"]))
    actual = run_prompt(ModelRunner(model, block_size=16, num_blocks=8), PROMPT, 1, [0, 1, 2])
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("slots", ["model", "bf16_model"])  # float32 or bfloat16 adapter slots
def test_a_sequence_is_bitwise_the_same_whatever_adapters_its_neighbours_use(
    slots: str, adapters: dict[str, Path], request: pytest.FixtureRequest
) -> None:
    model = request.getfixturevalue(slots)
    for slot, name in enumerate(["r8", "r64", "qv", "mlp", "o"]):
        model.lora.load(slot, name, str(adapters[name]))
    p, a, b, c = PROMPT[:13], PROMPT[20:29], PROMPT[30:35], PROMPT[5:16]
    alone = ModelRunner(model, block_size=4, num_blocks=24)
    table = [9, 3, 12, 5]
    _, (prefill,) = alone.execute(StepPlan(p, [13], [0], [table], [12], [(0, 13)], adapter_slots=[0]))
    decode, _ = alone.execute(StepPlan([7], [1], [13], [table], [0], [], adapter_slots=[0]))

    crowd = ModelRunner(model, block_size=4, num_blocks=24)
    tables = [[0, 7, 2], [11, 4, 15, 6], [14, 1], [16, 17, 18]]
    slots = [2, 0, -1, 4]
    _, (crowd_prefill,) = crowd.execute(
        StepPlan(a + p + b + c, [9, 13, 5, 11], [0, 0, 0, 0], tables, [8, 21, 26, 37], [(9, 13)], adapter_slots=slots)
    )
    crowd_decode, _ = crowd.execute(
        StepPlan([3, 7, 4, 5], [1, 1, 1, 1], [9, 13, 5, 11], tables, [0, 1, 2, 3], [], adapter_slots=[1, 0, 3, -1])
    )
    assert torch.equal(crowd_prefill, prefill)
    assert torch.equal(crowd_decode[1], decode[0])


@pytest.mark.parametrize("slots", ["model", "bf16_model"])
def test_the_native_stack_adds_the_adapters_bit_for_bit_as_the_eager_layers(
    slots: str, adapters: dict[str, Path], request: pytest.FixtureRequest
) -> None:
    """Adapters on the default fast path: a mixed step (three adapters and the base, prefill and decode)
    through the native decoder stack gives the eager layers' bits."""
    model = request.getfixturevalue(slots)
    for slot, name in enumerate(["r8", "r64", "qv", "mlp"]):
        model.lora.load(slot, name, str(adapters[name]))
    a, b, c = PROMPT[:9], PROMPT[10:23], PROMPT[25:31]
    tables, slots = [[0, 1, 2], [3, 4, 5, 6], [7, 8]], [3, -1, 1]
    results = []
    for executor in ("native-stack", "eager"):
        runner = ModelRunner(model, block_size=4, num_blocks=12, executor=executor)
        _, (prefill,) = runner.execute(
            StepPlan(a + b + c, [9, 13, 6], [0, 0, 0], tables, [8, 21, 27], [(9, 13)], adapter_slots=slots)
        )
        decode, _ = runner.execute(
            StepPlan([5, 6, 7], [1, 1, 1], [9, 13, 6], tables, [0, 1, 2], [], adapter_slots=[0, 2, 1])
        )
        results.append((prefill, decode))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_by_default_adapters_are_stored_in_bfloat16_at_their_rank(base: tuple[Path, Any]) -> None:
    """The default configuration (--dtype auto): two bytes a weight, each projection's A [r, in] and B [out, r]
    at the served rank with no padding: r * (in + out) * 2 bytes per projection."""
    model = load(LoadOptions(model=str(base[0]), max_loras=1, max_lora_rank=8))
    assert model.plan.lora_dtype.value == "bfloat16" and "bfloat16" in model.plan.summary()["lora"]
    c = model.config
    q, kv, h, i = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.hidden_size, c.intermediate_size
    per_layer = (h + q) + 2 * (h + kv) + (q + h) + 2 * (h + i) + (i + h)
    assert model.lora.bytes_per_slot == 8 * per_layer * 2 * c.num_layers


def test_bfloat16_adapter_slots_stay_close_to_transformers_plus_peft(
    bf16_model: Any, base: tuple[Path, Any], adapters: dict[str, Path]
) -> None:
    bf16_model.lora.load(0, "r64", str(adapters["r64"]))
    ours = torch.log_softmax(run_prompt(ModelRunner(bf16_model, block_size=16, num_blocks=8), PROMPT, 0, [0, 1, 2]), -1)
    with torch.inference_mode():
        theirs = torch.log_softmax(peft_model(base[1], adapters["r64"])(torch.tensor([PROMPT])).logits[0], -1)
        plain = torch.log_softmax(base[1](torch.tensor([PROMPT])).logits[0], -1)
    # bfloat16 keeps 8 bits of each weight (a relative error of 2^-9): within 1% of the adapter's effect.
    error, effect = (ours - theirs).abs().max().item(), (theirs - plain).abs().max().item()
    assert error < effect / 100, (error, effect)


def test_compile_auto_with_adapters_runs_the_native_stack_and_says_why(base: tuple[Path, Any]) -> None:
    plan = load_model(base[0], compile="auto", max_loras=1).plan
    assert plan.executor.value == "native-stack"
    assert plan.summary()["skipped.compile"] == "LoRA adapters (--max-loras) are not run inside compiled regions"


# One block of A, or three (a packed layer's, one column count not a multiple of 16); float32 or bfloat16.
@pytest.mark.parametrize("parts", [None, [(0, 64), (64, 21), (85, 11)]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_grouped_product_is_its_per_token_definition(
    parts: list[tuple[int, int]] | None, dtype: torch.dtype
) -> None:
    """Each slot's own rank per block (one not targeted), only those rows read: the rows past a slot's
    rank hold garbage here, and the product still is the definition at those ranks."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 128, generator=g)
    p = len(parts or [0])
    a = (torch.randn(4, p, 20, 128, generator=g) * 0.1).to(dtype)
    bt = (torch.randn(4, 20, 96, generator=g) * 0.1).to(dtype)
    ranks = torch.tensor([[20, 3, 0], [7, 20, 1], [1, 0, 16], [13, 13, 13]])[:, :p].contiguous()
    token_slots = torch.randint(-1, 4, (37,), generator=g).tolist()
    groups = [(s, torch.tensor([t for t, x in enumerate(token_slots) if x == s])) for s in range(4) if s in token_slots]
    stack = LoRAStack(a, bt, ranks, parts or [(0, 96)])
    delta = torch.zeros(37, 96)
    for rows, d in lora_delta(x, stack, groups):
        delta[rows] = d
    expected = lora_delta_reference(x, stack, token_slots)
    torch.testing.assert_close(delta.double(), expected, atol=1e-5, rtol=1e-5)
    # A row's bits are the same in a group of one (the first and last of each group: other tile positions).
    for rows, d in lora_delta(x, stack, groups):
        for i in (0, len(rows) - 1):
            ((_, alone),) = lora_delta(x, stack, [(token_slots[int(rows[i])], rows[i : i + 1])])
            assert torch.equal(alone[0], d[i])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_of_a_large_group_has_its_bits_alone(dtype: torch.dtype) -> None:
    """The native kernel splits a slot's rows into work items of a few rows each: a row's delta is the same
    bits at every place in a group of 29 (and in another slot's company) as alone."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, 64, generator=g)
    a = (torch.randn(2, 2, 16, 64, generator=g) * 0.1).to(dtype)
    bt = (torch.randn(2, 16, 150, generator=g) * 0.1).to(dtype)
    stack = LoRAStack(a, bt, torch.tensor([[16, 5], [9, 16]]), [(0, 100), (100, 50)])
    groups = [(0, torch.arange(3, 32)), (1, torch.tensor([0, 1, 2, 35, 39]))]
    for (slot, rows), (_, delta) in zip(groups, lora_delta(x, stack, groups), strict=True):
        for i in range(len(rows)):
            ((_, alone),) = lora_delta(x, stack, [(slot, rows[i : i + 1])])
            assert torch.equal(alone[0], delta[i])


def test_adapters_that_do_not_fit_the_base_are_refused_by_name(
    model: Any, base: tuple[Path, Any], adapters: dict[str, Path], tmp_path: Path
) -> None:
    config = model.config
    with pytest.raises(AdapterError, match="rank 64, above the served --max-lora-rank 16"):
        read_adapter("big", adapters["r64"], config, max_rank=16)
    other = tiny_llama(tmp_path / "wide", intermediate_size=192)
    wide = make_adapter(other, tmp_path / "wide-adapter", 8, seed=1, targets=["up_proj"])
    with pytest.raises(
        AdapterError,
        match=r"does not fit the base at model.layers.0.mlp.up_proj: lora_A is \[8, 128\] and lora_B \[192, 8\]",
    ):
        read_adapter("wide", wide, config, max_rank=64)
    head = make_adapter(base[1], tmp_path / "head", 8, seed=1, targets=["lm_head"])
    with pytest.raises(AdapterError, match="targets no servable projection"):
        read_adapter("head", head, config, max_rank=64)
    cfg = json.loads((adapters["r8"] / "adapter_config.json").read_text())
    (tmp_path / "dora").mkdir()
    (tmp_path / "dora" / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    (tmp_path / "dora" / "adapter_model.safetensors").write_bytes(
        (adapters["r8"] / "adapter_model.safetensors").read_bytes()
    )
    with pytest.raises(AdapterError, match="DoRA"):
        read_adapter("dora", tmp_path / "dora", config, max_rank=64)
    with pytest.raises(AdapterError, match="is not a LoRA adapter"):
        read_adapter("none", tmp_path, config, max_rank=64)


def write_gguf_lora(adapter: Path, out: Path, num_heads: int, num_kv_heads: int, kind: str = "lora") -> Path:
    """A GGUF LoRA file as llama.cpp's convert_lora_to_gguf.py writes one for a Llama: its metadata, its tensor
    names, and the rows of q's and k's B permuted as its converter permutes the base weights."""
    import gguf
    from safetensors.torch import load_file

    from tests.engine.test_gguf_loader import llama_cpp_permute

    parts = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output"}
    parts |= {"gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
    config = json.loads((adapter / "adapter_config.json").read_text())
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_type("adapter")
    writer.add_string("adapter.type", kind)
    writer.add_float32("adapter.lora.alpha", float(config["lora_alpha"]))
    for key, tensor in sorted(load_file(str(adapter / "adapter_model.safetensors")).items()):
        module = key.removeprefix("base_model.model.").rsplit(".", 2)[0]
        layer, leaf = int(module.split(".")[2]), module.rpartition(".")[2]
        which = "lora_a" if ".lora_A." in key else "lora_b"
        if which == "lora_b" and leaf in ("q_proj", "k_proj"):
            tensor = llama_cpp_permute(tensor, num_heads, num_kv_heads if leaf == "k_proj" else None)
        writer.add_tensor(f"blk.{layer}.{parts[leaf]}.weight.{which}", tensor.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def test_a_gguf_lora_file_gives_the_peft_adapters_logits(model: Any, adapters: dict[str, Path], tmp_path: Path) -> None:
    path = write_gguf_lora(adapters["r8"], tmp_path / "r8.gguf", 2, 2)
    model.lora.load(0, "r8", str(adapters["r8"]))
    model.lora.load(1, "r8-gguf", str(path))
    runner = ModelRunner(model, block_size=16, num_blocks=8)
    assert torch.equal(run_prompt(runner, PROMPT, 1, [0, 1, 2]), run_prompt(runner, PROMPT, 0, [3, 4, 5]))
    bad = write_gguf_lora(adapters["r8"], tmp_path / "other.gguf", 2, 2, kind="control_vector")
    with pytest.raises(AdapterError, match="not a LoRA adapter"):
        read_adapter("bad", bad, model.config, max_rank=64)


# -- tensor parallel: each rank its slice of B (column-parallel) or A (row-parallel) -------------------


def _delta(layer: Any, lora: Any, x: torch.Tensor) -> torch.Tensor:
    ((_, delta),) = lora_delta(x, lora.stack, [(0, torch.arange(x.shape[0]))])
    return delta


def test_tensor_parallel_shards_of_an_adapter_make_up_the_whole(
    base: tuple[Path, Any], adapters: dict[str, Path]
) -> None:
    """Two ranks' shards (loaded as each rank loads them): column-parallel deltas side by side, packed
    projections each in its place, row-parallel partial deltas summing to the whole (the all-reduce)."""
    models = [load_model(base[0], tp=TensorParallel(r, 2), max_loras=1, max_lora_rank=8) for r in range(2)]
    whole = load_model(base[0], max_loras=1, max_lora_rank=8)
    for m in (*models, whole):
        m.lora.load(0, "r8", str(adapters["r8"]))
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(1))
    for name, (layer, lora) in whole.lora.layers.items():
        expected = _delta(layer, lora, x[:, : layer.in_features])
        shards = [m.lora.layers[name] for m in models]
        if name.endswith(("o_proj", "down_proj")):
            parts = [
                _delta(ly, lo, x[:, r * ly.in_features : (r + 1) * ly.in_features]) for r, (ly, lo) in enumerate(shards)
            ]
            torch.testing.assert_close(parts[0] + parts[1], expected, atol=1e-5, rtol=1e-5)
            continue
        assembled = torch.full_like(expected, float("nan"))
        for _, shard in lora.projections:
            place = layer._pieces(shard)[0][2]
            for ly, lo in shards:
                ((start, count, local),) = ly._pieces(shard)
                assembled[:, place + start : place + start + count] = _delta(ly, lo, x[:, : layer.in_features])[
                    :, local : local + count
                ]
        torch.testing.assert_close(assembled, expected, atol=1e-5, rtol=1e-5)
