"""Which reader builds the tokenizer for a model path: a GGUF file's metadata or a Hugging Face directory."""

from __future__ import annotations

from pathlib import Path

from tokenmill_service.tokenizer.gguf import tokenizer_from_gguf
from tokenmill_service.tokenizer.hf import tokenizer_from_hf_dir
from tokenmill_service.tokenizer.tokenizer import Tokenizer, TokenizerError


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer for a model path: a GGUF file, or a Hugging Face directory with tokenizer.json."""
    path = Path(path)
    if path.is_dir():
        return tokenizer_from_hf_dir(path)
    if path.is_file():
        with path.open("rb") as f:
            magic = f.read(4)
        if magic == b"GGUF":
            return tokenizer_from_gguf(path)
        raise TokenizerError(f"{path} is not a GGUF file")
    raise FileNotFoundError(f"no tokenizer at {path}")
