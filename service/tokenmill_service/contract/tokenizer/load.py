"""Which reader builds the tokenizer for a model path: a GGUF file's metadata or a Hugging Face directory."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from tokenmill_service.contract.gguf_reader import open_model_file
from tokenmill_service.contract.tokenizer.gguf import tokenizer_from_gguf
from tokenmill_service.contract.tokenizer.hf import tokenizer_from_hf_dir
from tokenmill_service.contract.tokenizer.tokenizer import Tokenizer, TokenizerError

if TYPE_CHECKING:
    import gguf


def load_tokenizer(path: str | Path, reader: gguf.GGUFReader | None = None) -> Tokenizer:
    """The tokenizer for a model path: a GGUF file, or a Hugging Face directory with tokenizer.json.
    ``reader``: the GGUF file already opened (``open_model_file``), read rather than opened again."""
    path = Path(path)
    if path.is_dir():
        return tokenizer_from_hf_dir(path)
    if not path.is_file():
        raise FileNotFoundError(f"no tokenizer at {path}")
    reader = reader if reader is not None else open_model_file(path)
    if reader is None:
        raise TokenizerError(f"{path} is not a GGUF file")
    return tokenizer_from_gguf(path, reader)
