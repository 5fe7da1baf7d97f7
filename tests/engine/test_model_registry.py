"""Families own their names: the loaders learn every Hugging Face and GGUF architecture from the
registry, a name is registered once, and an unsupported checkpoint is refused naming what runs."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import gguf
import numpy as np
import pytest

from tokenmill_service.worker.models import registry
from tokenmill_service.worker.models.decoder import DecoderForCausalLM
from tokenmill_service.worker.models.gguf_loader import GGUFError, load_gguf
from tokenmill_service.worker.models.hf_loader import HFCheckpointError, read_hf_config
from tokenmill_service.worker.models.llama import LLAMA
from tokenmill_service.worker.models.registry import family, gguf_architectures, hf_architectures, register_family
from tokenmill_service.worker.models.spec import FamilySpec, Names


def test_the_loaders_names_come_from_the_families() -> None:
    hf = hf_architectures()
    assert {hf[name] for name in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")} == {
        "llama",
        "mistral",
        "qwen2",
    }
    assert hf["Qwen3ForCausalLM"] == "qwen3"
    assert gguf_architectures()["mistral"] == "llama"  # llama-shaped, permuted q/k as llama's
    for name, arch in {**hf, **gguf_architectures()}.items():
        spec = family(arch)
        assert name in {**spec.names.hf, **spec.names.gguf}


@pytest.mark.parametrize(
    ("names", "hf", "gguf_names", "clash"),
    [
        (("llama",), {}, {}, "architecture 'llama'"),
        (("new",), {"Qwen3ForCausalLM": "new"}, {}, "Hugging Face architecture 'Qwen3ForCausalLM'"),
        (("new",), {}, {"qwen2": "new"}, "GGUF architecture 'qwen2'"),
        (("new",), {"NewForCausalLM": "other"}, {}, "does not register"),
    ],
)
def test_a_name_already_registered_is_refused(
    names: tuple[str, ...], hf: dict[str, str], gguf_names: dict[str, str], clash: str
) -> None:
    family("llama")  # the built-in families registered first
    before = (hf_architectures(), gguf_architectures())
    with pytest.raises(ValueError, match=clash):
        register_family(FamilySpec(names, DecoderForCausalLM, Names(hf, gguf_names)))
    assert (hf_architectures(), gguf_architectures()) == before  # nothing half-registered
    with pytest.raises(ValueError, match="'new' has no model here"):
        family("new")


def test_a_new_family_is_found_by_both_loaders_names(monkeypatch: pytest.MonkeyPatch) -> None:
    family("llama")
    for table in ("_FAMILIES", "_HF_NAMES", "_GGUF_NAMES"):
        monkeypatch.setattr(registry, table, dict(getattr(registry, table)))
    # A Llama-shaped family is a spec: Llama's module under names of its own.
    new = dataclasses.replace(
        LLAMA, architectures=("newfam",), names=Names({"NewForCausalLM": "newfam"}, {"newfam": "newfam"})
    )
    assert register_family(new) is new and family("newfam") is new
    assert hf_architectures()["NewForCausalLM"] == "newfam" and gguf_architectures()["newfam"] == "newfam"


def test_an_unsupported_hf_architecture_is_refused_naming_the_supported_ones(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(HFCheckpointError, match="GPT2LMHeadModel") as excinfo:
        read_hf_config(tmp_path)
    assert all(name in str(excinfo.value) for name in hf_architectures())


def test_an_unsupported_gguf_architecture_is_refused_naming_the_supported_ones(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFError, match="'gpt2' is not supported") as excinfo:
        load_gguf(path)
    assert all(name in str(excinfo.value) for name in gguf_architectures())
