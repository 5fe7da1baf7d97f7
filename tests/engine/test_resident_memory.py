"""A loaded model's resident memory holds what it runs, not the file a second time: layers that repack
their weights read the GGUF once while loading, and its pages are dropped from the process after; what
repacking allocated and freed goes back to the system."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from structlog.testing import capture_logs

from tokenmill_service.contract.gguf_reader import open_gguf, release_pages
from tokenmill_service.worker.models.resident_memory import anonymous_mib, release_freed_heap


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


def test_memory_freed_while_loading_goes_back_to_the_system() -> None:
    # What repacking does to the heap: many buffers below the allocator's mmap threshold, all but the last
    # freed. glibc keeps the freed ones in its arenas (the last one pins the heap's top) until trimmed.
    buffers = [bytearray(64 * 1024) for _ in range(3200)]  # 200 MiB, every page touched
    keep = buffers[-1]
    del buffers
    held = anonymous_mib()
    released = release_freed_heap()
    assert held is not None and released is not None
    assert released > 150, f"only {released} MiB of 200 freed came back"
    assert len(keep) == 64 * 1024


def test_loading_a_model_returns_the_heap_it_freed(default_model_path: Path) -> None:
    from tokenmill_service.contract.plan import LoadOptions
    from tokenmill_service.worker.loader import load

    with capture_logs() as logs:
        load(LoadOptions(model=str(default_model_path)))
    (loaded,) = [entry for entry in logs if entry["event"] == "model_loaded"]
    assert isinstance(loaded["heap_released_mib"], int)
