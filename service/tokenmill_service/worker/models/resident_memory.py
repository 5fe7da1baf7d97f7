"""Give the C heap's freed memory back to the system once a model is loaded.

Repacking a GGUF's blocks (the k-quant and VNNI layouts) allocates and frees temporary buffers on every
loading thread. glibc's allocator keeps freed memory in its arenas for reuse rather than returning it,
so after loading a process could hold the repacked weights plus most of what repacking used on the
way: on an OLMoE-1B-7B-shaped Q4_K_M file (4.0 GiB), 875 MiB. ``malloc_trim`` returns it. Elsewhere
(musl, macOS) there is no such call and nothing to do.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from pathlib import Path


def anonymous_mib() -> int | None:
    """This process's anonymous resident memory in MiB (None where /proc does not say)."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return None
    return next((int(line.split()[1]) // 1024 for line in status.splitlines() if line.startswith("RssAnon:")), None)


def release_freed_heap() -> int | None:
    """Return the heap's free memory to the system (glibc ``malloc_trim(0)``); the MiB released, or None
    where the C library has no such call or /proc does not say."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    before = anonymous_mib()
    trim(0)
    after = anonymous_mib()
    return None if before is None or after is None else before - after
