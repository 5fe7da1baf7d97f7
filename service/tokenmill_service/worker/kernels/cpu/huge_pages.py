"""Packed weights in 2 MB pages. A decoding step reads every weight once, as one stream per thread; in 4 KB
pages each page of that stream is a TLB miss and a restart of the hardware prefetchers. Measured on a 2-core
Intel Xeon, a 1B model's products at one row from memory: 1.10-1.14 times as fast from 2 MB pages, and the
machine's plain streaming read 1.06 times as fast (bench/history.md).

Linux gives a private anonymous mapping 2 MB pages where it is asked to (``MADV_HUGEPAGE``) and the kernel's
transparent huge pages are not switched off. The buffers are cut one after another from such mappings of at
least 64 MB (an arena), so that a small buffer (a 1B model's attention products: 2-4 MB) and a large one's last,
partial page lie in 2 MB pages too, shared with the next buffer rather than half empty: a 1B model's 64 decoder
products at one row from memory, each in a mapping of its own (buffers under 4 MB and last partial pages in
4 KB pages), read 1.16 times as slowly as from one arena. Elsewhere, and for buffers under 64 KB, this is
``torch.empty``."""

from __future__ import annotations

import mmap
import threading
import weakref
from dataclasses import dataclass

import torch

PAGE = 2 << 20
SMALLEST = 64 << 10  # below it, an ordinary tensor: a few 4 KB pages
ARENA = 64 << 20  # the least size of a new mapping
ALIGN = 4096  # where each buffer starts: a 4 KB page of its own


@dataclass
class _Arena:
    """The mapping buffers are now cut from: weakly held, so that it goes back to the system when every buffer
    cut from it has gone."""

    region: weakref.ref[mmap.mmap]
    start: int  # the offset of its first 2 MB boundary
    used: int  # bytes from there already cut
    size: int  # bytes from there that may be cut


_lock = threading.Lock()
_arena: _Arena | None = None


def empty_bytes(nbytes: int) -> torch.Tensor:
    """An uninitialized uint8 tensor of ``nbytes`` on the CPU, in 2 MB pages where the system gives them (its
    start aligned to 4 KB). Its memory goes back to the system when it and every other buffer cut from the same
    mapping are gone."""
    if nbytes < SMALLEST or getattr(mmap, "MADV_HUGEPAGE", None) is None:
        return torch.empty(nbytes, dtype=torch.uint8)
    global _arena
    with _lock:
        region = _arena.region() if _arena is not None else None
        if _arena is None or region is None or _arena.used + nbytes > _arena.size:
            if _arena is not None and region is not None:
                _release_rest(region, _arena)
            region, _arena = _new_arena(nbytes)
        offset = _arena.start + _arena.used
        _arena.used += -(-nbytes // ALIGN) * ALIGN
        return torch.frombuffer(region, dtype=torch.uint8, offset=offset, count=nbytes)


def _new_arena(nbytes: int) -> tuple[mmap.mmap, _Arena]:
    size = max(ARENA, -(-nbytes // PAGE) * PAGE)
    # One page more than the arena, so that a 2 MB-aligned start lies inside.
    region = mmap.mmap(-1, size + PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    address = torch.frombuffer(region, dtype=torch.uint8, count=1).data_ptr()
    start = -address % PAGE
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, AttributeError):  # no transparent huge pages here: 4 KB pages, as torch's would be
        pass
    return region, _Arena(weakref.ref(region), start, 0, size)


def _release_rest(region: mmap.mmap, arena: _Arena) -> None:
    """Gives back the uncut rest of a mapping no more buffers will be cut from: the part of its last 2 MB page
    that no buffer uses (the page's other 4 KB pages stay)."""
    rest = arena.start + arena.used
    end = min(len(region), -(-rest // PAGE) * PAGE)
    if rest < end:
        try:
            region.madvise(mmap.MADV_DONTNEED, rest, end - rest)
        except (OSError, AttributeError, ValueError):
            pass
