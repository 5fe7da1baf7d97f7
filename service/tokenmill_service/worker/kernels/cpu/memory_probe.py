"""The rate at which this machine streams memory into its cores (memory_probe.cpp): what a decode
step's weight reads are measured against. Used by tokenmill-bench's machine section."""

from __future__ import annotations

import time

import torch

from tokenmill_service.worker.kernels.cpu import build, huge_pages

_LINE = 256  # bytes each step of the probe reads


def unavailable_reason() -> str | None:
    return build.unavailable_reason("memory_probe")


def stream_read(buffer: torch.Tensor, threads: int) -> int:
    """The probe's checksum of ``buffer`` (uint8, 64-byte aligned, a multiple of 256 bytes) read by
    ``threads`` threads: the sum of its 64-bit little-endian words, modulo 2^64, as a signed int."""
    if buffer.dtype != torch.uint8 or buffer.numel() % _LINE or buffer.data_ptr() % 64:
        raise ValueError("the probe reads a 64-byte aligned uint8 buffer of whole 256-byte lines")
    return int(build.load("memory_probe").tm_stream_read(buffer.data_ptr(), buffer.numel(), threads))


def read_gbs(size: int, repeats: int, threads: int) -> float:
    """Best-of-``repeats`` rate, in 10^9 bytes a second, of reading a ``size``-byte buffer once on
    ``threads`` threads."""
    lines = max(1, size // _LINE)
    # In 2 MB pages where the system gives them, as the packed weights are (huge_pages.py); filled, so that
    # every page is faulted in before the timing.
    buffer = huge_pages.empty_bytes(lines * _LINE).fill_(1)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        stream_read(buffer, threads)
        best = min(best, time.perf_counter() - start)
    return buffer.numel() / best / 1e9


def read_in_turn_gbs(sizes: list[int], repeats: int, threads: int) -> float:
    """Best-of-``repeats`` rate, in 10^9 bytes a second, of reading buffers of ``sizes`` bytes (rounded down to
    whole 256-byte lines, at least one), one after another, each in a call of its own on ``threads`` threads: a
    decoding step's reads of its layers' weights, product after product, without their arithmetic. The buffers
    lie as the packed weights do, one after another in 2 MB pages (huge_pages.py)."""
    buffers = [huge_pages.empty_bytes(max(1, size // _LINE) * _LINE).fill_(1) for size in sizes]
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for buffer in buffers:
            stream_read(buffer, threads)
        best = min(best, time.perf_counter() - start)
    return sum(buffer.numel() for buffer in buffers) / best / 1e9
