"""The memory probe tokenmill-bench measures the machine's read rate with: it reads every byte of
the buffer (its checksum is the buffer's), on any thread count, and refuses buffers it cannot read whole."""

import pytest
import torch

from tokenmill_service.worker.kernels.cpu import memory_probe

pytestmark = pytest.mark.skipif(memory_probe.unavailable_reason() is not None, reason="native kernels unavailable")


def _words_sum(buffer: torch.Tensor) -> int:
    total = int(buffer.view(torch.int64).sum())  # torch wraps modulo 2^64 as the probe does
    return (total + 2**63) % 2**64 - 2**63


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_probe_reads_every_byte_on_any_thread_count(threads: int) -> None:
    gen = torch.Generator().manual_seed(threads)
    buffer = torch.randint(0, 256, (256 * 1031,), dtype=torch.uint8, generator=gen)
    assert memory_probe.stream_read(buffer, threads) == _words_sum(buffer)
    buffer[-1] ^= 1  # the last line is read too
    assert memory_probe.stream_read(buffer, threads) == _words_sum(buffer)


def test_the_probe_refuses_a_buffer_it_cannot_read_whole() -> None:
    with pytest.raises(ValueError, match="whole 256-byte lines"):
        memory_probe.stream_read(torch.zeros(300, dtype=torch.uint8), 1)
    with pytest.raises(ValueError, match="aligned"):
        memory_probe.stream_read(torch.zeros(257 * 256, dtype=torch.uint8)[1 : 1 + 256 * 256], 1)


def test_the_rate_is_a_rate() -> None:
    assert memory_probe.read_gbs(4 * 2**20, repeats=2, threads=1) > 0


def test_reading_buffers_in_turn_gives_a_rate_whatever_their_sizes() -> None:
    assert memory_probe.read_in_turn_gbs([3 * 2**20, 100_000, 300], repeats=2, threads=2) > 0
