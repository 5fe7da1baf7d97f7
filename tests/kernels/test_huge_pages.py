"""Packed weights lie in 2 MB pages where Linux gives them (huge_pages.py): a decoding step streams every weight
once, and in 4 KB pages each page is a TLB miss and a restart of the prefetchers. The buffer is what was asked
for, buffers follow one another in shared mappings, whose memory goes back when their last buffer goes, and the
packers use it."""

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


def _resident_kb(address: int, nbytes: int) -> int:
    """kB of [address, address + nbytes) in memory now (/proc/self/pagemap's present bit, 4 KB page by page)."""
    first, last = address // 4096, (address + nbytes - 1) // 4096
    with open("/proc/self/pagemap", "rb") as pagemap:
        pagemap.seek(first * 8)
        entries = pagemap.read((last - first + 1) * 8)
    present = sum(entries[i + 7] >> 7 for i in range(0, len(entries), 8))
    return 4 * present


HUGE_PAGES = pytest.mark.skipif(
    not THP.exists() or "[never]" in THP.read_text() or not hasattr(mmap, "MADV_HUGEPAGE"),
    reason="no transparent huge pages on this system",
)


def test_a_large_buffer_is_what_was_asked_for_and_starts_on_a_page() -> None:
    buffer = huge_pages.empty_bytes(5 * 2**20 + 123)
    assert buffer.dtype == torch.uint8 and buffer.numel() == 5 * 2**20 + 123 and buffer.is_contiguous()
    assert buffer.data_ptr() % huge_pages.ALIGN == 0
    buffer.fill_(7)
    assert int(buffer[-1]) == 7 and int(buffer.sum()) == 7 * buffer.numel()


def test_a_small_buffer_is_an_ordinary_tensor() -> None:
    buffer = huge_pages.empty_bytes(1000)
    assert buffer.numel() == 1000 and buffer.dtype == torch.uint8


@HUGE_PAGES
def test_buffers_follow_one_another_in_huge_pages_and_their_mapping_goes_back_with_the_last() -> None:
    # Larger than an arena: a mapping of its own, which the next buffers share.
    first = huge_pages.empty_bytes(huge_pages.ARENA + 300_000)
    smalls = [huge_pages.empty_bytes(300_000) for _ in range(4)]
    for a, b in zip([first, *smalls], smalls, strict=False):
        assert b.data_ptr() == a.data_ptr() + -(-a.numel() // huge_pages.ALIGN) * huge_pages.ALIGN
    for buffer in [first, *smalls]:
        buffer.fill_(1)
    address = first.data_ptr()
    assert (_mapped_kb(address, first.numel(), "AnonHugePages") or 0) >= 2048
    del first
    gc.collect()
    assert _mapped_kb(address, 4096, "Rss") is not None  # the small buffers hold the mapping
    del smalls, buffer, a, b
    gc.collect()
    assert _mapped_kb(address, 4096, "Rss") is None  # unmapped


@HUGE_PAGES
def test_the_unused_rest_of_a_mapping_goes_back_when_the_next_buffer_needs_a_new_one() -> None:
    # A mapping of ARENA + 2 MB; the buffer's last bytes fault in its last 2 MB page, of which 4 KB are used.
    buffer = huge_pages.empty_bytes(huge_pages.ARENA + 4096).fill_(1)
    end = buffer.data_ptr() + buffer.numel()
    if _resident_kb(end, huge_pages.PAGE - 4096) == 0:
        pytest.skip("the system gave that page in 4 KB pages (no 2 MB page free): no rest to give back")
    after = huge_pages.empty_bytes(4 * 2**20)  # does not fit in the rest: a new mapping, the rest given back
    assert _resident_kb(end, huge_pages.PAGE - 4096) == 0
    assert _resident_kb(buffer.data_ptr(), buffer.numel()) == buffer.numel() // 1024
    assert int(buffer[-1]) == 1 and after.numel() == 4 * 2**20


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of this process's mapping that holds ``address``."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    return []


@pytest.mark.skipif(kquant_gemm.unavailable_reason() is not None, reason="native kernels unavailable")
def test_packed_k_quant_weights_lie_in_the_huge_page_buffer() -> None:
    blocks = torch.randint(0, 256, (2048, 16, 144), dtype=torch.uint8)  # 2048 rows of K = 4096 in Q4_K: 4.8 MB
    blocks[..., :4] = torch.tensor([0x00, 0x1C, 0x00, 0x1C], dtype=torch.uint8)  # d, dmin = 1/256
    packed = kquant_gemm.pack(blocks, int(GGMLQuantizationType.Q4_K))
    assert packed.numel() >= huge_pages.SMALLEST and packed.data_ptr() % huge_pages.ALIGN == 0


@HUGE_PAGES
@pytest.mark.skipif(kquant_gemm.unavailable_reason() is not None, reason="native kernels unavailable")
def test_a_small_layers_packed_weights_lie_in_a_mapping_given_huge_pages() -> None:
    # Regression: weights under 4 MB (a 1B model's attention products, every layer of the embedded model) were
    # ordinary tensors in 4 KB pages, and read 1.2-1.4 times as slowly from memory.
    blocks = torch.randint(0, 256, (512, 8, 144), dtype=torch.uint8)  # 512 rows of K = 2048 in Q4_K: 0.6 MB
    blocks[..., :4] = torch.tensor([0x00, 0x1C, 0x00, 0x1C], dtype=torch.uint8)
    packed = kquant_gemm.pack(blocks, int(GGMLQuantizationType.Q4_K))
    assert packed.numel() < 4 * 2**20
    assert "hg" in _vm_flags(packed.data_ptr())  # madvise(MADV_HUGEPAGE)
