"""Packed weights lie in 2 MB pages where Linux gives them (huge_pages.py): a decoding step streams every weight
once, and in 4 KB pages each page is a TLB miss and a restart of the prefetchers. The buffer is what was asked
for, its memory goes back when the tensor goes, and the packers use it."""

import gc
import mmap
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType

from tokenmill_service.worker.kernels.cpu import huge_pages, kquant_gemm

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _mapped_kb(address: int, nbytes: int, field: str) -> int | None:
    """``field`` (kB) summed over this process's mappings that overlap [address, address + nbytes), None if none
    does (madvise may have split the buffer's mapping in two)."""
    total, inside, found = 0, False, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's first line: "start-end perms ..."
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start < address + nbytes and address < end
            found |= inside
        elif inside and head == f"{field}:":
            total += int(line.split()[1])
    return total if found else None


def test_a_large_buffer_is_what_was_asked_for_and_starts_on_a_2_mb_boundary() -> None:
    buffer = huge_pages.empty_bytes(5 * 2**20 + 123)
    assert buffer.dtype == torch.uint8 and buffer.numel() == 5 * 2**20 + 123 and buffer.is_contiguous()
    if hasattr(mmap, "MADV_HUGEPAGE"):
        assert buffer.data_ptr() % huge_pages.PAGE == 0
    buffer.fill_(7)
    assert int(buffer[-1]) == 7 and int(buffer.sum()) == 7 * buffer.numel()


def test_a_small_buffer_is_an_ordinary_tensor() -> None:
    buffer = huge_pages.empty_bytes(1000)
    assert buffer.numel() == 1000 and buffer.dtype == torch.uint8


@pytest.mark.skipif(
    not THP.exists() or "[never]" in THP.read_text() or not hasattr(mmap, "MADV_HUGEPAGE"),
    reason="no transparent huge pages on this system",
)
def test_the_system_backs_a_large_buffer_with_huge_pages_and_takes_it_back() -> None:
    buffer = huge_pages.empty_bytes(16 * 2**20).fill_(1)
    address = buffer.data_ptr()
    assert (_mapped_kb(address, buffer.numel(), "AnonHugePages") or 0) >= 2048
    # A partial last page stays in 4 KB pages: a buffer of 5 MB and a bit holds about that much, not 6 MB.
    odd = huge_pages.empty_bytes(5 * 2**20 + 4096).fill_(1)
    assert 5 * 1024 + 4 <= (_mapped_kb(odd.data_ptr(), odd.numel(), "Rss") or 0) < 6 * 1024
    del buffer
    gc.collect()
    assert _mapped_kb(address, 16 * 2**20, "Rss") is None  # unmapped


@pytest.mark.skipif(kquant_gemm.unavailable_reason() is not None, reason="native kernels unavailable")
def test_packed_k_quant_weights_lie_in_the_huge_page_buffer() -> None:
    blocks = torch.randint(0, 256, (2048, 16, 144), dtype=torch.uint8)  # 2048 rows of K = 4096 in Q4_K: 4.8 MB
    blocks[..., :4] = torch.tensor([0x00, 0x1C, 0x00, 0x1C], dtype=torch.uint8)  # d, dmin = 1/256
    packed = kquant_gemm.pack(blocks, int(GGMLQuantizationType.Q4_K))
    assert packed.numel() >= huge_pages.SMALLEST and packed.data_ptr() % huge_pages.PAGE == 0
