"""The values other parts of the server are given (the load options, the engine's knobs, the request limits)
take each flag of their field's name, and only a field that means something else than its flag is given by
hand: ``Settings.subset`` refuses to copy a flag into a field of another type."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from tokenmill_service.contract.config import Settings, load_settings
from tokenmill_service.contract.engine_config import EngineConfig
from tokenmill_service.contract.plan.options import LoadOptions
from tokenmill_service.front.router.spec import worker_spec
from tokenmill_service.front.validation import Limits


def test_the_load_options_carry_every_flag_they_name() -> None:
    asked: dict[str, Any] = {"model": "m.gguf", "device": "cuda", "dtype": "bfloat16", "quantization": "int8"}
    asked |= {"backend": "triton", "kv_cache_dtype": "float16", "activations": "int8", "cpu_isa": "avx2"}
    asked |= {"compile": "auto", "tensor_parallel": 2, "expert_parallel": True, "max_loras": 3, "max_lora_rank": 8}
    asked |= {"speculative_method": "mtp", "max_model_len": 128}
    settings = Settings(**asked, port=1, max_queue=7)
    assert LoadOptions.from_settings(settings) == LoadOptions(**asked)


def test_load_options_made_in_process_take_the_instruction_set_from_the_environment_as_the_flag_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Loading makes the options' instruction set the process's (TOKENMILL_CPU_ISA): an in-process load with the
    # default options once set "auto"'s choice there, undoing an AVX2 run's TOKENMILL_CPU_ISA=avx2 (make test-avx2).
    monkeypatch.setenv("TOKENMILL_CPU_ISA", "avx2")
    assert LoadOptions().cpu_isa == "avx2"
    assert load_settings([], environ={"TOKENMILL_CPU_ISA": "avx2"}).cpu_isa == "avx2"
    assert LoadOptions(cpu_isa="scalar").cpu_isa == "scalar"
    monkeypatch.delenv("TOKENMILL_CPU_ISA")
    assert LoadOptions().cpu_isa == "auto"


def test_the_engine_is_given_bytes_a_whole_batch_and_whether_events_are_published() -> None:
    flags = ["--max-batch-size", "8", "--max-batch-tokens", "4", "--block-size", "32", "--kv-cache-memory", "2GiB"]
    flags += ["--speculative-tokens", "3", "--speculative-max-batch", "2", "--speculative-method", "ngram"]
    flags += ["--max-model-len", "64", "--kv-events-endpoint", "tcp://*:5557"]
    spec = worker_spec(load_settings(flags, environ={}), 1, 0, 0, 0)
    assert spec.engine == EngineConfig(
        max_batch_size=8,
        max_batch_tokens=8,  # at least a decode token for each sequence of the batch
        block_size=32,
        kv_cache_memory=2 * 1024**3,
        max_model_len=64,
        kv_events=True,
        speculative_tokens=3,
        speculative_max_batch=2,
        speculative_method="ngram",
    )
    assert spec.options.max_model_len == 64


def test_the_request_limits_are_the_flags_with_the_models_bounds() -> None:
    flags = ["--max-new-tokens-limit", "100", "--default-max-new-tokens", "50", "--max-top-logprobs", "5"]
    flags += ["--max-stop-strings", "2", "--json-schema-permissive"]
    settings = load_settings(flags, environ={})
    expected = Limits(2048, 32000, 100, 5, 2, default_max_new_tokens=50, json_schema_permissive=True)
    assert Limits.from_settings(settings, 2048, 32000) == expected
    assert Limits.from_settings(settings) == Limits(0, 0, 100, 5, 2, 50, True)  # while the model loads


@dataclass
class _Bytes:
    kv_cache_memory: int = 0  # bytes, where the flag is text ("2GiB")
    max_queue: int = 0


def test_a_field_typed_otherwise_than_its_flag_must_be_given() -> None:
    settings = Settings(kv_cache_memory="2GiB", max_queue=9)
    with pytest.raises(TypeError, match=r"_Bytes.kv_cache_memory is int, the setting str: give its value"):
        settings.subset(_Bytes)
    assert settings.subset(_Bytes, kv_cache_memory=settings.kv_cache_bytes) == _Bytes(2 * 1024**3, 9)
