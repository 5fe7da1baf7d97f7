"""Reading a checkpoint, apart from building a model from it: its configuration, how each tensor is
stored, and the tensors themselves (lazily, in file order).

GGUF files and Hugging Face safetensors directories are supported; neither format can run code
when read, and pickled checkpoints are never opened.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import gguf
from gguf import GGMLQuantizationType as QType

from tokenmill_service.contract.gguf_reader import open_model_file, release_pages
from tokenmill_service.contract.model_paths import ModelLoadError
from tokenmill_service.worker.layers.quant.gguf_blocks import CheckpointTensor
from tokenmill_service.worker.models.config import ModelConfig
from tokenmill_service.worker.models.gguf_loader import iter_gguf
from tokenmill_service.worker.models.hf_loader import is_hf_checkpoint, iter_hf
from tokenmill_service.worker.models.registry import family


@dataclass(eq=False)
class Checkpoint:
    path: Path
    config: ModelConfig  # ``config.name`` is the model's name (the file's or the directory's)
    # Each tensor's GGUF storage type, by the model's (Hugging Face) name; for safetensors, those a family
    # stores as blocks (gpt-oss's MXFP4 experts), else empty.
    tensor_types: dict[str, QType]
    # The tensors as stored (GGUF blocks stay memory-mapped until a layer takes its slice); read once.
    tensors: Iterator[tuple[str, CheckpointTensor]]
    # Called once the model is built: drops the file's pages the loading read from resident memory.
    release_pages: Callable[[], None] = lambda: None
    format: str = "safetensors"  # or "gguf"


def open_checkpoint(path: Path, reader: gguf.GGUFReader | None = None) -> Checkpoint:
    """The checkpoint at ``path``, its tensors not read yet (ModelLoadError if it is not one). ``reader``: the
    GGUF file already opened (``open_model_file``), read rather than opened again."""
    path = Path(path)
    if reader is None:
        reader = open_model_file(path)
    if reader is not None:
        config, types, items = iter_gguf(path, reader)
        config.name = path.name.removesuffix(".gguf")
        opened = reader
        return Checkpoint(path, config, types, items, lambda: release_pages(opened), "gguf")
    if is_hf_checkpoint(path):
        config, hf_items = iter_hf(path)
        config.name = path.resolve().name
        return Checkpoint(path, config, family(config.architecture).tensors.hf_stored_types(config), hf_items)
    if path.is_dir():
        raise ModelLoadError(f"{path} is a directory without config.json; expected a Hugging Face checkpoint")
    raise ModelLoadError(f"{path} is neither a GGUF file nor a Hugging Face checkpoint directory")
