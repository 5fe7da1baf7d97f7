"""What the benchmark ran on, and how fast this machine can copy memory (the ceiling for decode on CPU)."""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

COPY_BUFFER_BYTES = 256 * 1024 * 1024  # at least; twice the last-level cache where that is larger (buffer_bytes)


def last_level_cache_bytes() -> int | None:
    """The largest CPU cache Linux reports for core 0 (its L3, often shared by the whole host's tenants)."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()  # "491520K"
        except OSError:
            continue
        unit = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * unit)
    return max(sizes, default=None)


def buffer_bytes(mib: int | None = None) -> int:
    """The size of the buffers the memory rates are measured on: ``mib`` MiB where given (``--copy-buffer-mib``),
    else 256 MiB, or twice the last-level cache where that is larger (an Intel Xeon VM reports 480 MiB of L3: read
    from a 256 MiB buffer, its 'memory' rate was 1.08 times the rate from 812 MiB, a 1B model's weights), so that
    the rate is memory's, not the cache's."""
    if mib:
        return mib * 2**20
    return max(COPY_BUFFER_BYTES, 2 * (last_level_cache_bytes() or 0))


def _first_line_value(path: str, key: str) -> str | None:
    try:
        for line in Path(path).read_text().splitlines():
            name, sep, value = line.partition(":")
            if sep and name.strip() == key:
                return value.strip()
    except OSError:
        pass
    return None


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _simd_flags() -> list[str]:
    flags = (_first_line_value("/proc/cpuinfo", "flags") or "").split()
    return sorted(f for f in flags if f.startswith(("avx", "amx", "fma")))


def memory_total_bytes() -> int | None:
    value = _first_line_value("/proc/meminfo", "MemTotal")  # "24684948 kB"
    return int(value.split()[0]) * 1024 if value else None


def loadavg() -> list[float] | None:
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


def machine_info(device: str | None) -> dict[str, Any]:
    """Cores, memory, CPU model and library versions; ``device`` is the server's (from GetModelInfo)."""
    total = memory_total_bytes()
    return {
        "cores": os.cpu_count(),
        "memory_bytes": total,
        "memory_gib": round(total / 2**30, 1) if total else None,
        "cpu_model": _first_line_value("/proc/cpuinfo", "model name") or platform.processor() or None,
        "cpu_mhz": _first_line_value("/proc/cpuinfo", "cpu MHz"),
        # Virtual machines often report a bare model name; the vector extensions say what the kernels can use.
        "cpu_simd_flags": _simd_flags(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch_version": _version("torch"),
        "numpy_version": _version("numpy"),
        "grpcio_version": _version("grpcio"),
        "tokenmill_version": _version("tokenmill"),
        "device": device,
    }


def copy_bandwidth(size: int | None = None, repeats: int = 5) -> dict[str, Any]:
    """Best-of-``repeats`` copy of a ``size``-byte buffer, with numpy (one thread) and torch (all its threads).

    Convention: bytes moved = 2 x size (the source read plus the destination write, as STREAM's Copy
    counts them; write-allocate traffic is not counted). GB/s are 10^9 bytes per second. The
    headline ``gbs`` is the faster of the two methods. ``size``: buffer_bytes() unless given.
    """
    size = size or buffer_bytes()
    return _bandwidth_record(
        _numpy_copy_gbs(size, repeats),
        _torch_copy_gbs(size, repeats),
        size,
        repeats,
        convention="2 x buffer bytes (read + write) / best time; GB = 1e9 bytes",
    )


def read_bandwidth(size: int | None = None, repeats: int = 5) -> dict[str, Any]:
    """Best-of-``repeats`` read of a ``size``-byte buffer: a sum with numpy (one thread) and torch (all its
    threads), and tokenmill's native probe (AVX-512 loads on torch's threads) where it can run: the rate at
    which this machine can stream memory in, which is what a decode step does with its weights. Bytes moved
    = ``size`` (read only; buffer_bytes() unless given); GB/s are 10^9 bytes per second; ``gbs`` is the fastest
    method. The native probe reads from 2 MB pages, as the server's packed weights lie."""
    size = size or buffer_bytes()
    record = _bandwidth_record(
        _numpy_read_gbs(size, repeats),
        _torch_read_gbs(size, repeats),
        size,
        repeats,
        convention="buffer bytes (read only) / best time of one read (a sum, or the native probe's loads); GB = 1e9 bytes",
    )
    native = _native_read_gbs(size, repeats)
    if native is not None:
        record["by_method_gbs"][native[0]] = native[1]
        if native[1] > record["gbs"]:
            record["gbs"], record["method"] = native[1], native[0]
    return record


# The threads' product runs at least this long, so that a process holding a core beside it shows in its CPU ticks.
BUSY_WINDOW_S = 0.2


def core_scaling(repeats: int = 5) -> dict[str, Any] | None:
    """How many times as fast torch's threads together multiply a float32 matrix as one of them alone: about the
    thread count on a quiet machine, near 1 when something else holds a core (another tenant of a virtual
    machine's host), in which minutes every figure that takes both cores comes out low. Beside it, the other
    processes of this machine that were busiest while the threads multiplied (``busy_beside``): where one held a
    core, it is named. None without torch."""
    try:
        import torch
    except ImportError:
        return None
    threads = torch.get_num_threads()
    a = torch.randn(512, 512)
    seconds = {}
    try:
        for n in (1, threads):
            torch.set_num_threads(n)
            torch.mm(a, a)  # warm: the thread pool started, the caches filled
            if n == threads:
                before, started = process_cpu_ticks(), time.perf_counter()
            seconds[n] = _best_of(lambda: torch.mm(a, a), repeats)
        while time.perf_counter() - started < BUSY_WINDOW_S:
            torch.mm(a, a)
        busy = busiest_processes(before, process_cpu_ticks(), time.perf_counter() - started)
    finally:
        torch.set_num_threads(threads)
    return {
        "threads": threads,
        "one_thread_s": seconds[1],
        "all_threads_s": seconds[threads],
        "speedup": seconds[1] / seconds[threads],
        "busy_beside": busy,
    }


def process_cpu_ticks() -> dict[int, tuple[str, int]]:
    """Every process's name and user + system CPU ticks so far, by pid (/proc; empty where there is none)."""
    ticks = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # gone meanwhile
        rest = stat[stat.rindex(")") + 2 :].split()
        ticks[int(entry.name)] = (stat[stat.index("(") + 1 : stat.rindex(")")], int(rest[11]) + int(rest[12]))
    return ticks


def busiest_processes(
    before: dict[int, tuple[str, int]], after: dict[int, tuple[str, int]], seconds: float, top: int = 3
) -> list[dict[str, Any]]:
    """The ``top`` processes other than this one that used the most CPU between two process_cpu_ticks, each with
    the cores it kept busy on average over ``seconds`` (those that used none left out)."""
    used = [
        (ticks - before[pid][1], pid, name)
        for pid, (name, ticks) in after.items()
        if pid in before and pid != os.getpid() and ticks > before[pid][1]
    ]
    return [
        {"pid": pid, "name": name, "cores": round(t / _CLOCK_TICKS / seconds, 2)}
        for t, pid, name in sorted(used, reverse=True)[:top]
    ]


def _bandwidth_record(
    numpy_gbs: float, torch_gbs: tuple[str, float] | None, size: int, repeats: int, convention: str
) -> dict[str, Any]:
    """One bandwidth record: the faster of the methods measured, and each method's figure."""
    results = {"numpy": numpy_gbs}
    if torch_gbs is not None:
        results[torch_gbs[0]] = torch_gbs[1]
    best = max(results, key=lambda k: results[k])
    return {
        "gbs": results[best],
        "method": best,
        "by_method_gbs": results,
        "buffer_bytes": size,
        "repeats": repeats,
        "convention": convention,
    }


def _numpy_read_gbs(size: int, repeats: int) -> float:
    import numpy as np

    src = np.ones(size // 4, dtype=np.float32)
    return size / _best_of(src.sum, repeats) / 1e9


def _torch_read_gbs(size: int, repeats: int) -> tuple[str, float] | None:
    try:
        import torch
    except ImportError:
        return None
    src = torch.ones(size // 4, dtype=torch.float32)
    return f"torch_{torch.get_num_threads()}_threads", size / _best_of(src.sum, repeats) / 1e9


def _native_read_gbs(size: int, repeats: int) -> tuple[str, float] | None:
    """The service's native probe (AVX-512 loads on torch's threads, no arithmetic to wait on), where
    tokenmill's kernels are installed and can be built; a float sum can be bound by its additions."""
    try:
        import torch

        from tokenmill_service.worker.kernels.cpu import memory_probe
    except ImportError:
        return None
    if memory_probe.unavailable_reason() is not None:
        return None
    threads = torch.get_num_threads()
    return f"native_avx512_{threads}_threads", memory_probe.read_gbs(size, repeats, threads)


def _numpy_copy_gbs(size: int, repeats: int) -> float:
    import numpy as np

    src = np.ones(size, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in before timing
    return 2 * size / _best_of(lambda: np.copyto(dst, src), repeats) / 1e9


def _torch_copy_gbs(size: int, repeats: int) -> tuple[str, float] | None:
    try:
        import torch
    except ImportError:
        return None
    src = torch.ones(size, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    return f"torch_{torch.get_num_threads()}_threads", 2 * size / _best_of(lambda: dst.copy_(src), repeats) / 1e9


def _best_of(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def busy_cpu_seconds() -> float | None:
    """CPU seconds all cores have spent busy since boot (/proc/stat: everything but idle and iowait)."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except (OSError, IndexError):
        return None
    ticks = [int(f) for f in fields[:8]]  # user nice system idle iowait irq softirq steal
    return (sum(ticks) - ticks[3] - ticks[4]) / _CLOCK_TICKS


def process_cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of ``pids`` so far (processes that are gone count 0)."""
    total = 0.0
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        # Fields after the parenthesised command name (which may itself hold spaces): utime is the 12th.
        rest = stat[stat.rindex(")") + 2 :].split()
        total += (int(rest[11]) + int(rest[12])) / _CLOCK_TICKS
    return total


def rss_bytes(pids: list[int]) -> int:
    """Summed resident set size of ``pids`` (processes that are gone count 0)."""
    total = 0
    for pid in pids:
        value = _first_line_value(f"/proc/{pid}/status", "VmRSS")
        if value:
            total += int(value.split()[0]) * 1024
    return total


_LOOPBACK = ("localhost", "127.0.0.1", "::1", "0.0.0.0", "")


def local_server_pids(address: str, rank_pids: list[int]) -> list[int] | None:
    """The processes of a tokenmill server this benchmark did not start, when it runs on this machine:
    its worker ranks (``rank_pids``, as GetModelInfo reports them) and the server process that spawned
    them. None when the server is elsewhere (another host, or a container whose pids are not ours), so
    its CPU cannot be told apart from other processes'."""
    host = address.rsplit(":", 1)[0].strip("[]") if ":" in address else address
    if host not in _LOOPBACK or not rank_pids:
        return None
    found = set(rank_pids)
    for pid in rank_pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            parent = int(stat[stat.rindex(")") + 2 :].split()[1])
            command = Path(f"/proc/{parent}/cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            return None
        if b"tokenmill" not in command:
            return None  # not ours: the same pid in another pid namespace
        found.add(parent)
    return sorted(found)
