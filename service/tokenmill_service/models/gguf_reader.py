"""Opening a GGUF file quickly, without torch (the tokenizer reads the same metadata as the loader)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import numpy.typing as npt


class _PlainArrayReader(gguf.GGUFReader):
    """``GGUFReader`` slicing a plain ndarray view of its memmap instead of the memmap itself.

    The reader parses the tokenizer's ~100k strings with one slice each, and every ``np.memmap``
    slice pays a Python-level ``__array_finalize__``: that is 1.5 s of a 2 s open. A plain view
    of the same mapping reads the same bytes (tensors stay memory-mapped) without that cost.
    """

    @property  # type: ignore[override]
    def data(self) -> npt.NDArray[Any]:
        return self._plain_data

    @data.setter
    def data(self, value: npt.NDArray[Any]) -> None:
        self._plain_data = value.view(np.ndarray)


def open_gguf(path: Path) -> gguf.GGUFReader:
    try:
        return _PlainArrayReader(path)
    except ValueError as e:
        # The reader meets a tensor type id ggml has no name for as a bare enum error; say what it means.
        if "GGMLQuantizationType" not in str(e):
            raise
        raise ValueError(
            f"{path}: a tensor's type is not one the gguf package knows ({e}): the file is damaged, or newer "
            "than this gguf"
        ) from e
