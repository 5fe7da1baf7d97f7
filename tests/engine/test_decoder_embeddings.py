"""A Qwen3 embedding decoder written to GGUF as llama.cpp writes Qwen3-Embedding (``qwen3`` with ``qwen3.pooling_type``
3, EOS added after a text): loaded by the generation loader, its layers run over each input alone give
sentence-transformers' last-token vectors within 1e-5."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from tests.embedding_checkpoints import TEXTS, write_tiny_qwen3_embedding
from tests.engine.test_gguf_loader import convert_hf_to_gguf
from tests.lora_adapters import make_adapter
from tokenmill_service.worker.loader import load_model
from tokenmill_service.worker.models.embedder import Embedder, decoder_hidden_states
from tokenmill_service.worker.models.embedding_spec import EmbeddingSpec, read_embedding_spec

transformers = pytest.importorskip("transformers")
pytest.importorskip("sentence_transformers")


def test_a_qwen3_embedding_gguf_gives_sentence_transformers_last_token_vectors(tmp_path: Path) -> None:
    directory, reference = write_tiny_qwen3_embedding(tmp_path / "qwen3-embedding")
    config = transformers.AutoConfig.from_pretrained(directory)
    causal = transformers.Qwen3ForCausalLM(config)
    causal.model.load_state_dict(transformers.AutoModel.from_pretrained(directory).state_dict())
    eos = reference.tokenizer.convert_tokens_to_ids("<|eos|>")

    def pooling(writer: gguf.GGUFWriter) -> None:  # what llama.cpp's converter adds for Qwen3-Embedding
        writer.add_pooling_type(gguf.PoolingType.LAST)
        writer.add_eos_token_id(eos)
        writer.add_add_eos_token(True)

    path = tmp_path / "qwen3-embedding.gguf"
    convert_hf_to_gguf(causal.eval(), "qwen3", path, metadata=pooling)
    spec = read_embedding_spec(path)
    assert spec == EmbeddingSpec("last", True, False, 0, (), (eos,))
    model = load_model(path)
    embedder = Embedder(decoder_hidden_states(model), spec, config.hidden_size, model.device)
    ids = [reference.tokenizer(text)["input_ids"] for text in TEXTS]
    assert all(one[-1] == eos for one in ids)
    got = np.stack([np.frombuffer(v, dtype="<f4") for v in embedder.embed(ids)])
    expected = reference.encode(TEXTS, convert_to_numpy=True)
    assert float(np.abs(got - expected).max()) <= 1e-5
    # An input's vector is its own: alone, or after others.
    assert embedder.embed([ids[2]])[0] == embedder.embed(ids)[2]


def test_a_decoder_with_lora_slots_embeds_with_the_base_weights_whatever_the_last_step_used(tmp_path: Path) -> None:
    directory, reference = write_tiny_qwen3_embedding(tmp_path / "qwen3-embedding")
    spec = read_embedding_spec(directory)
    assert spec is not None
    model = load_model(directory, max_loras=1)
    assert model.lora is not None
    base = transformers.Qwen3ForCausalLM(transformers.AutoConfig.from_pretrained(directory))
    model.lora.load(0, "adapter", str(make_adapter(base, tmp_path / "adapter", rank=4, seed=1)))
    embedder = Embedder(decoder_hidden_states(model), spec, model.config.hidden_size, model.device)
    model.lora.batch.set([0] * 32, model.device)  # what a step of 32 tokens on the adapter left behind
    ids = reference.tokenizer(TEXTS[3])["input_ids"]
    got = np.frombuffer(embedder.embed([ids])[0], dtype="<f4")
    assert float(np.abs(got - reference.encode([TEXTS[3]], convert_to_numpy=True)[0]).max()) <= 1e-5
