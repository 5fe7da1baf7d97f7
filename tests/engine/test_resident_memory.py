"""A loaded model's resident memory holds what it runs, not the file a second time: layers that repack
their weights read the GGUF once while loading, and its pages are dropped from the process after."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tokenmill_service.models.gguf_reader import open_gguf, release_pages


def _rss_file_mib() -> int:
    status = Path("/proc/self/status").read_text()
    return next(int(line.split()[1]) // 1024 for line in status.splitlines() if line.startswith("RssFile:"))


def test_the_files_pages_leave_resident_memory_and_stay_readable(default_model_path: Path) -> None:
    reader = open_gguf(default_model_path)
    size_mib = reader.data.nbytes // 2**20
    before = _rss_file_mib()
    checksum = int(np.asarray(reader.data[::4096], dtype=np.int64).sum())  # one byte a page: every page in
    touched = _rss_file_mib()
    assert touched - before > 0.8 * size_mib
    release_pages(reader)
    assert _rss_file_mib() - before < 0.1 * size_mib
    # The mapping is still valid: what was read reads the same (the pages come back from the page cache).
    assert int(np.asarray(reader.data[::4096], dtype=np.int64).sum()) == checksum
