"""How a Hugging Face directory embeds, read as sentence-transformers would: its modules, its pooling (old and new
keys), its tokenizer's special tokens around a text; and what is refused, naming it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tokenmill_service.worker.models.embedding_spec import EmbeddingConfigError, EmbeddingSpec, read_embedding_spec

TRANSFORMER = {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}
POOLING = {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
NORMALIZE = {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
BERT_PROCESSING = {"type": "BertProcessing", "sep": ["[SEP]", 102], "cls": ["[CLS]", 101]}


def checkpoint(
    root: Path, architecture: str, modules: list[dict[str, Any]] | None = None, pooling: dict[str, Any] | None = None
) -> Path:
    root.mkdir()
    (root / "config.json").write_text(json.dumps({"architectures": [architecture]}))
    (root / "tokenizer.json").write_text(json.dumps({"post_processor": BERT_PROCESSING}))
    if modules is not None:
        (root / "modules.json").write_text(json.dumps(modules))
    if pooling is not None:
        (root / "1_Pooling").mkdir()
        (root / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return root


def test_the_older_pooling_flags_and_normalize_are_read(tmp_path: Path) -> None:
    pooling = {"word_embedding_dimension": 384, "pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}
    root = checkpoint(tmp_path / "bge", "BertModel", [TRANSFORMER, POOLING, NORMALIZE], pooling)
    (root / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 512, "do_lower_case": True}))
    assert read_embedding_spec(root) == EmbeddingSpec("cls", True, True, 512, (101,), (102,))


def test_a_bare_encoder_is_mean_pooled_unnormalized_and_a_bare_decoder_does_not_embed(tmp_path: Path) -> None:
    assert read_embedding_spec(checkpoint(tmp_path / "bert", "BertModel")) == EmbeddingSpec(
        "mean", False, True, 0, (101,), (102,)
    )
    assert read_embedding_spec(checkpoint(tmp_path / "chat", "Qwen3ForCausalLM")) is None


@pytest.mark.parametrize(
    ("modules", "pooling", "says"),
    [
        (
            [TRANSFORMER, POOLING, {**NORMALIZE, "type": "sentence_transformers.models.Dense"}],
            {"pooling_mode": "mean"},
            "Dense",
        ),
        ([TRANSFORMER, POOLING], {"pooling_mode": "max"}, "pooling ['max']"),
        ([TRANSFORMER, POOLING], {"pooling_mode_weightedmean_tokens": True}, "weightedmean"),
        ([TRANSFORMER, POOLING], {"pooling_mode": "lasttoken", "include_prompt": False}, "include_prompt"),
    ],
    ids=["dense", "max", "weighted-mean", "without-prompt"],
)
def test_what_is_not_computed_here_is_refused_naming_it(
    tmp_path: Path, modules: list[dict[str, Any]], pooling: dict[str, Any], says: str
) -> None:
    root = checkpoint(tmp_path / "model", "Qwen3ForCausalLM", modules, pooling)
    with pytest.raises(EmbeddingConfigError, match="not supported") as caught:
        read_embedding_spec(root)
    assert says in str(caught.value)
