"""A process finds its model once and opens the file once: the worker reads its tokenizer, configuration and
tensors from one open GGUF reader, and the server's tokenizer (with its chat template) opens the file once."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tokenmill_service.contract.gguf_reader import open_model_file
from tokenmill_service.contract.plan import LoadOptions
from tokenmill_service.contract.tokenizer import load_tokenizer
from tokenmill_service.worker.loader import load_planned

_WATCHED: list[tuple[str, list[str]]] = []  # (path, the opens seen while it is watched)


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event == "open" and _WATCHED and isinstance(args[0], (str, bytes, os.PathLike)):
        path, seen = _WATCHED[-1]
        if os.fsdecode(args[0]) == path:
            seen.append(path)


sys.addaudithook(_audit)  # audit hooks stay for the process: it counts only inside ``opens``


@contextmanager
def opens(path: Path) -> Iterator[list[str]]:
    seen: list[str] = []
    _WATCHED.append((str(path), seen))
    try:
        yield seen
    finally:
        _WATCHED.pop()


def test_the_server_s_tokenizer_opens_the_model_file_once(default_model_path: Path) -> None:
    with opens(default_model_path) as seen:
        tokenizer = load_tokenizer(default_model_path)
    assert tokenizer.vocab_size > 0 and len(seen) == 1


def test_a_worker_opens_the_model_file_once_for_its_tokenizer_and_weights(default_model_path: Path) -> None:
    with opens(default_model_path) as seen:
        reader = open_model_file(default_model_path)
        tokenizer = load_tokenizer(default_model_path, reader)
        model, _ = load_planned(LoadOptions(model=str(default_model_path)), path=default_model_path, reader=reader)
    assert tokenizer.vocab_size == model.config.vocab_size
    assert len(seen) == 1
