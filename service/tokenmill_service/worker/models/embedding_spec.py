"""Whether and how a checkpoint embeds, read without torch: which hidden states make the vector (pooling),
whether it is scaled to length 1, and the special tokens its tokenizer puts around a text.

- A Hugging Face directory embeds where sentence-transformers would: with ``modules.json`` (a Transformer,
  then ``1_Pooling/config.json``'s pooling, then maybe ``Normalize``), or as an encoder (BERT) without it, as
  sentence-transformers wraps a bare transformers model (mean pooling, not normalized).
- A GGUF file embeds where it says ``{arch}.pooling_type`` (llama.cpp's: 1 mean, 2 CLS, 3 last token), or
  where it is an encoder (``bert``, mean by default); its vectors are normalized, as llama.cpp's server does.

A checkpoint that embeds otherwise (another pooling, a Dense module) is refused, naming what is not supported.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenmill_service.contract.model_dims import is_gguf
from tokenmill_service.contract.model_paths import ModelLoadError

if TYPE_CHECKING:
    import gguf

# The encoders served (worker/models/bert.py): Hugging Face ``architectures`` and GGUF ``general.architecture`` names.
ENCODER_HF_ARCHITECTURES = frozenset({"BertModel", "BertForMaskedLM", "BertForPreTraining"})
ENCODER_GGUF_ARCHITECTURES = frozenset({"bert"})
# llama.cpp's LLAMA_POOLING_TYPE_* values, as a GGUF's ``{arch}.pooling_type`` writes them.
GGUF_POOLING = {1: "mean", 2: "cls", 3: "last"}
# sentence-transformers' pooling modes (both its older boolean keys and its newer ``pooling_mode``).
_ST_POOLING = {"cls": "cls", "mean": "mean", "lasttoken": "last"}
_ST_POOLING_FLAGS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_lasttoken": "last",
}
_ST_OTHER_FLAGS = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")


class EmbeddingConfigError(ModelLoadError):
    """The checkpoint describes embeddings this service does not compute."""


@dataclass(frozen=True, slots=True)
class EmbeddingSpec:
    pooling: str  # "cls", "mean" or "last"
    normalize: bool
    encoder: bool  # an encoder only embeds; a decoder also generates
    # The most tokens one input may hold (sentence-transformers' max_seq_length); 0: the model's context.
    max_tokens: int = 0
    prefix_ids: tuple[int, ...] = ()
    suffix_ids: tuple[int, ...] = ()


def is_encoder(path: Path, reader: gguf.GGUFReader | None = None) -> bool:
    """Whether the checkpoint at ``path`` is an encoder (it embeds and never generates). ``reader``: its GGUF
    file already open (read rather than opened again)."""
    if reader is not None or is_gguf(path):
        arch = _gguf_fields(path, ["general.architecture"], reader)["general.architecture"]
        return arch in ENCODER_GGUF_ARCHITECTURES
    raw = _read_json(path / "config.json") or {}
    return any(a in ENCODER_HF_ARCHITECTURES for a in raw.get("architectures") or [])


def read_embedding_spec(path: Path, reader: gguf.GGUFReader | None = None) -> EmbeddingSpec | None:
    """How the checkpoint at ``path`` embeds; None: it does not (a chat model). EmbeddingConfigError: it
    embeds in a way not supported here. ``reader``: its GGUF file already open."""
    return _gguf_spec(path, reader) if reader is not None or is_gguf(path) else _hf_spec(path)


# -- Hugging Face directories --------------------------------------------------------------------


def _hf_spec(root: Path) -> EmbeddingSpec | None:
    encoder = is_encoder(root)
    modules = _read_json_list(root / "modules.json")
    if modules is None and not encoder:
        return None
    pooling, normalize = "mean", False
    if modules is not None:
        pooling, normalize = _st_modules(root, modules)
    st_config = _read_json(root / "sentence_bert_config.json") or {}
    max_tokens = int(st_config.get("max_seq_length") or 0)
    prefix, suffix = _template_ids(root)
    return EmbeddingSpec(pooling, normalize, encoder, max_tokens, prefix, suffix)


def _st_modules(root: Path, modules: list[Any]) -> tuple[str, bool]:
    """The pooling and normalization of sentence-transformers' modules (Transformer, Pooling[, Normalize])."""
    kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules if isinstance(m, dict)]
    pooling_at = kinds.index("Pooling") if "Pooling" in kinds else -1
    if not kinds or kinds[0] != "Transformer" or pooling_at != 1 or kinds[2:] not in ([], ["Normalize"]):
        raise EmbeddingConfigError(
            f"{root / 'modules.json'}: sentence-transformers modules {kinds} are not supported "
            "(supported: Transformer, Pooling, and optionally Normalize)"
        )
    directory = root / str(modules[pooling_at].get("path", ""))
    config = _read_json(directory / "config.json")
    if config is None:
        raise EmbeddingConfigError(f"{directory / 'config.json'} is missing: the pooling is not known")
    return _pooling(directory, config), kinds[2:] == ["Normalize"]


def _pooling(directory: Path, config: dict[str, Any]) -> str:
    mode = config.get("pooling_mode")
    if isinstance(mode, str):
        modes = [mode]
    else:
        modes = [name for flag, name in _ST_POOLING_FLAGS.items() if config.get(flag)]
        modes += [flag for flag in _ST_OTHER_FLAGS if config.get(flag)]
    if len(modes) != 1 or (modes[0] not in _ST_POOLING and modes[0] not in _ST_POOLING.values()):
        raise EmbeddingConfigError(
            f"{directory / 'config.json'}: pooling {modes} is not supported (supported: one of cls, mean, lasttoken)"
        )
    if config.get("include_prompt") is False:
        raise EmbeddingConfigError(f"{directory / 'config.json'}: include_prompt false is not supported")
    return _ST_POOLING.get(modes[0], modes[0])


def _template_ids(root: Path) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The special-token ids tokenizer.json's post-processor puts before and after a single text."""
    spec = _read_json(root / "tokenizer.json") or {}
    return _processor_ids(spec.get("post_processor"))


def _processor_ids(processor: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    if not isinstance(processor, dict):
        return (), ()
    kind = processor.get("type")
    if kind == "Sequence":
        prefix: tuple[int, ...] = ()
        suffix: tuple[int, ...] = ()
        for step in processor.get("processors") or []:
            before, after = _processor_ids(step)
            prefix, suffix = before + prefix, suffix + after
        return prefix, suffix
    if kind in ("BertProcessing", "RobertaProcessing"):
        return (int(processor["cls"][1]),), (int(processor["sep"][1]),)
    if kind != "TemplateProcessing":
        return (), ()
    specials = processor.get("special_tokens") or {}
    prefix_ids: list[int] = []
    suffix_ids: list[int] = []
    seen_text = False
    for piece in processor.get("single") or []:
        if "Sequence" in piece:
            seen_text = True
            continue
        ids = [int(i) for i in specials[piece["SpecialToken"]["id"]]["ids"]]
        (suffix_ids if seen_text else prefix_ids).extend(ids)
    return tuple(prefix_ids), tuple(suffix_ids)


# -- GGUF files ----------------------------------------------------------------------------------


def _gguf_spec(path: Path, reader: gguf.GGUFReader | None) -> EmbeddingSpec | None:
    if reader is None:
        from tokenmill_service.contract.gguf_reader import open_gguf

        reader = open_gguf(path)
    arch = _gguf_fields(path, ["general.architecture"], reader)["general.architecture"]
    keys = [
        f"{arch}.pooling_type",
        "tokenizer.ggml.seperator_token_id",
        "tokenizer.ggml.bos_token_id",
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.add_bos_token",
        "tokenizer.ggml.add_eos_token",
    ]
    fields = _gguf_fields(path, keys, reader)
    encoder = arch in ENCODER_GGUF_ARCHITECTURES
    kind = fields[f"{arch}.pooling_type"]
    if kind is None or (int(kind) == 0 and encoder):
        if not encoder:
            return None
        kind = 1  # llama.cpp's default for an encoder: mean
    if int(kind) not in GGUF_POOLING:
        raise EmbeddingConfigError(
            f"{path}: {arch}.pooling_type {int(kind)} is not supported (supported: 1 mean, 2 CLS, 3 last token)"
        )

    def token(*keys: str) -> tuple[int, ...]:
        found = next((fields[k] for k in keys if fields[k] is not None), None)
        return () if found is None else (int(found),)

    if encoder:  # llama.cpp's WPM tokenizer: [CLS] text [SEP] (its converter writes [CLS] as BOS)
        prefix = token("tokenizer.ggml.bos_token_id")
        suffix = token("tokenizer.ggml.seperator_token_id", "tokenizer.ggml.eos_token_id")
    else:
        prefix = token("tokenizer.ggml.bos_token_id") if fields["tokenizer.ggml.add_bos_token"] else ()
        suffix = token("tokenizer.ggml.eos_token_id") if fields["tokenizer.ggml.add_eos_token"] else ()
    return EmbeddingSpec(GGUF_POOLING[int(kind)], True, encoder, 0, prefix, suffix)


def _gguf_fields(path: Path, keys: list[str], reader: gguf.GGUFReader | None = None) -> dict[str, Any]:
    from tokenmill_service.contract.gguf_reader import open_gguf

    reader = reader if reader is not None else open_gguf(path)
    values: dict[str, Any] = {}
    for key in keys:
        field = reader.get_field(key)
        values[key] = None if field is None else field.contents()
    return values


def _read_json(path: Path) -> dict[str, Any] | None:
    loaded = _load(path)
    return loaded if isinstance(loaded, dict) else None


def _read_json_list(path: Path) -> list[Any] | None:
    loaded = _load(path)
    return loaded if isinstance(loaded, list) else None


def _load(path: Path) -> Any:
    if not path.is_file():
        return None
    with path.open(encoding="utf-8") as f:
        return json.load(f)
