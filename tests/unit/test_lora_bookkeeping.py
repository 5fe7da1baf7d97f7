"""LoRA bookkeeping without a model: the flags, the resident slots (least recently used makes room, never
one a running sequence holds), and prefix-cache blocks keyed by adapter."""

from __future__ import annotations

from typing import Any

import pytest

from tokenmill_service.contract.config import load_settings
from tokenmill_service.contract.request import GenerationRequest
from tokenmill_service.worker.engine.adapters import AdapterManager
from tokenmill_service.worker.engine.block_manager import BlockManager
from tokenmill_service.worker.engine.sequence import Sequence
from tokenmill_service.worker.layers.lora import LoRAAdapter
from tokenmill_service.worker.models.config import ModelConfig


def test_lora_flags_parse_and_are_environment_variables() -> None:
    settings = load_settings(["--max-loras", "2", "--lora-modules", "sql=/a/sql", "chat=/a/chat"], {})
    assert settings.lora_module_paths() == {"sql": "/a/sql", "chat": "/a/chat"}
    env = {"TOKENMILL_MAX_LORAS": "1", "TOKENMILL_LORA_MODULES": "x=/p/x", "TOKENMILL_MAX_LORA_RANK": "64"}
    settings = load_settings([], env)
    assert (settings.lora_module_paths(), settings.max_loras, settings.max_lora_rank) == ({"x": "/p/x"}, 1, 64)
    # --lora-modules alone serves its adapters: a slot each (vLLM's users start it so).
    assert load_settings(["--lora-modules", "x=/p", "y=/q"], {}).max_loras == 2
    assert load_settings(["--max-loras", "1", "--lora-modules", "x=/p", "y=/q"], {}).max_loras == 1
    with pytest.raises(ValueError, match="name=path, not 'nopath'"):
        load_settings(["--max-loras", "1", "--lora-modules", "nopath"], {})
    with pytest.raises(ValueError, match="names 'x' twice"):
        load_settings(["--max-loras", "1", "--lora-modules", "x=/a", "x=/b"], {})


def manager(slots: int, names: list[str]) -> AdapterManager:
    config = ModelConfig(96, 64, 128, 2, 2, 2, 128)
    m = AdapterManager(slots, 16, config)
    for n in names:  # registered as read_adapter would have, without files: acquire never reads them
        m.registered[n] = LoRAAdapter(n, f"/adapters/{n}", 8, 16.0, False)
    return m


def test_the_least_recently_used_adapter_no_running_sequence_holds_makes_room() -> None:
    m = manager(2, ["a", "b", "c"])
    assert m.acquire("a", set()) and m.acquire("b", set())
    assert m.take_loads() == [(0, "a", "/adapters/a"), (1, "b", "/adapters/b")]
    assert m.acquire("a", set()) and m.take_loads() == []  # resident: nothing to load
    assert m.acquire("c", {"a"}) and m.take_loads() == [(1, "c", "/adapters/c")]  # b was least recently used
    assert not m.acquire("b", {"a", "c"})  # every slot is held by a running sequence: wait
    assert m.slot_of("a") == 0 and m.slot_of("c") == 1 and m.slot_of("") == -1
    m.unregister("c")
    assert m.acquire("b", {"a"}) and m.take_loads() == [(1, "b", "/adapters/b")]


def seq(tokenizer: Any, ids: list[int], rid: str, adapter: str) -> Sequence:
    return Sequence(GenerationRequest(rid, ids, adapter=adapter), tokenizer)  # keyed by the name alone


def test_prefix_cache_blocks_are_reused_only_under_the_same_adapter(default_tokenizer: Any) -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    ids = list(range(10))
    first = seq(default_tokenizer, ids, "r0", "x")
    assert bm.allocate(first, 10)
    first.num_computed_tokens = 10
    bm.register_computed_blocks(first)
    hits = {}
    for rid, adapter in (("r1", "y"), ("r2", ""), ("r3", "x")):
        other = seq(default_tokenizer, ids, rid, adapter)
        bm.reuse_cached_prefix(other)
        hits[adapter] = other.num_cached_tokens
    assert hits == {"y": 0, "": 0, "x": 8}
    # The same name loaded again (the engine keys a sequence by its registration) finds nothing.
    again = seq(default_tokenizer, ids, "r4", "x")
    again.adapter_key = "x#2"
    bm.reuse_cached_prefix(again)
    assert again.num_cached_tokens == 0
