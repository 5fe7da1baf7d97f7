"""Opening a GGUF file quickly, without torch (the tokenizer reads the same metadata as the loader)."""

from __future__ import annotations

import ctypes
import mmap
import struct
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

    def _get_field_parts(
        self, orig_offs: int, raw_type: int
    ) -> tuple[int, list[npt.NDArray[Any]], list[int], list[gguf.GGUFValueType]]:
        """An array of strings or numbers parsed in one pass, into parts ``ReaderField.contents`` reads.

        gguf reads an array element by element, through several numpy calls each: a Llama 3 or Qwen
        vocabulary (128k tokens, 280k merges, their types and scores) took seconds to open."""
        if gguf.GGUFValueType(raw_type) != gguf.GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        item_type, count = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
        sub = gguf.GGUFValueType(item_type[0])
        n, offs = int(count[0]), orig_offs + 12
        parts: list[npt.NDArray[Any]] = [item_type, count]
        if sub == gguf.GGUFValueType.STRING:
            # Only each string's bytes as a part (what ``contents`` reads), not its length as gguf adds.
            data, unpack = self.data, struct.Struct("<Q").unpack_from
            view = data.data  # the array's bytes as a buffer (what unpack_from reads)
            for _ in range(n):
                (length,) = unpack(view, offs)
                parts.append(data[offs + 8 : offs + 8 + length])
                offs += 8 + length
            return offs - orig_offs, parts, list(range(2, 2 + n)), [gguf.GGUFValueType.ARRAY, sub]
        nptype = self.gguf_scalar_to_np.get(sub)
        if nptype is None:  # arrays of arrays
            return super()._get_field_parts(orig_offs, raw_type)
        values = self._get(offs, nptype, n)
        parts += [values[i : i + 1] for i in range(n)]
        return 12 + int(values.nbytes), parts, list(range(2, 2 + n)), [gguf.GGUFValueType.ARRAY, sub]

    @property  # type: ignore[override]
    def data(self) -> npt.NDArray[Any]:
        return self._plain_data

    @data.setter
    def data(self, value: npt.NDArray[Any]) -> None:
        self._plain_data = value.view(np.ndarray)


def release_pages(reader: gguf.GGUFReader) -> None:
    """Drop the file's pages from this process's resident memory (``madvise(MADV_DONTNEED)``), once the
    model holds what it needs: layers that repacked their weights read the file once while loading,
    and its pages would otherwise stay counted beside the copy. The mapping stays valid: a view still
    in use (an embedding table kept as stored) faults its pages back in from the page cache."""
    data = reader.data
    page = mmap.PAGESIZE
    start = data.ctypes.data // page * page
    length = data.ctypes.data + data.nbytes - start
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), mmap.MADV_DONTNEED)


def open_model_file(path: Path) -> gguf.GGUFReader | None:
    """The GGUF file at ``path``, opened once for everything a process reads from it (its tokenizer, its
    configuration, its tensors); None for a directory or a file that is not GGUF (the reader checks the magic,
    so the file is opened once either way)."""
    if not path.is_file():
        return None
    try:
        return open_gguf(path)
    except ValueError as e:
        if "GGUF magic invalid" in str(e):
            return None
        raise


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
