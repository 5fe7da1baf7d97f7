"""The KV cache pool's memory on the CPU: zeroed, and mapped as its blocks are first used."""

from __future__ import annotations

import gc

import torch

from tokenmill_service.worker.engine.model_runner import available_memory, zeroed


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_a_zeroed_pool_is_zeros_of_its_shape_and_dtype_and_writable() -> None:
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        t = zeroed((3, 16, 2, 64), dtype, torch.device("cpu"))
        assert t.shape == (3, 16, 2, 64) and t.dtype == dtype and t.is_contiguous()
        assert not t.any()
        t[1, 2, 1, 5] = 3.0
        gc.collect()  # the tensor alone keeps its memory
        assert t.sum().item() == 3.0 and t[1, 2, 1, 5].item() == 3.0
    assert zeroed((0, 4), torch.float32, torch.device("cpu")).shape == (0, 4)


def test_a_pool_takes_memory_only_as_its_pages_are_first_written() -> None:
    before = _rss()
    pool = zeroed((256, 1 << 18), torch.float32, torch.device("cpu"))  # 256 MiB
    assert _rss() - before < 16 << 20  # torch.zeros would have written all of it
    pool[:64] = 1.0  # a quarter of it
    grown = _rss() - before
    assert 48 << 20 < grown < 112 << 20, grown
    assert pool.sum().item() == 64 * (1 << 18)


def test_the_memory_available_is_read_from_the_kernel() -> None:
    available = available_memory()
    assert available is not None and available > 0
