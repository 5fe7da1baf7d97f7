"""Compiling and loading the native kernels: one shared library per C++ source in this folder.

A source is compiled once per machine (``g++ -O3 -march=native -fopenmp``, a few seconds) into a
cache directory and loaded with ctypes; later processes load the cached library. Every source
includes ``tm_abi.h``, generated from abi.py (the block table, the structs, each exported
function's prototype), and ``load`` types the library's functions from the same description, so a
C++ definition that disagrees with the Python side fails to compile. The cache key
covers the source, the flags, the compiler's version and the CPU (``-march=native`` depends on it),
so a shared cache never hands a library to a machine it was not built for. Where a kernel cannot
be built (no C++ compiler, a CPU without AVX-512) ``unavailable_reason`` says why and the callers
serve with torch's own kernels. ``TOKENMILL_NATIVE_KERNELS=0`` turns them all off.

OpenMP: the libraries link ``libgomp.so.1``, the soname torch's own OpenMP runtime has, so the
kernels share torch's thread pool rather than bringing a second one.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import structlog

from tokenmill_service.kernels.cpu import abi

log = structlog.get_logger(__name__)

HERE = Path(__file__).parent
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]


class NativeKernelUnavailable(RuntimeError):
    pass


def _cache_dirs() -> list[Path]:
    dirs = []
    if env := os.environ.get("TOKENMILL_KERNEL_CACHE"):
        dirs.append(Path(env))
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    dirs.append(Path(xdg) / "tokenmill" / "kernels")
    dirs.append(Path(tempfile.gettempdir()) / f"tokenmill-kernels-{os.getuid()}")
    return dirs


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU's model and flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "unknown"
    return "\n".join([line for line in lines if line.startswith(("model name", "flags"))][:2])


def _build(name: str, cxx: str) -> Path:
    source = HERE / f"{name}.cpp"
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False).stdout
    # What the sources include: the headers here, and tm_abi.h, generated from abi.py.
    headers = [h.read_text() for h in sorted(HERE.glob("*.h"))] + [abi.header()]
    key = "\0".join([source.read_text(), *headers, " ".join(FLAGS), version, _cpu_signature()])
    target_name = f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"
    errors = []
    for directory in _cache_dirs():
        target = directory / target_name
        if target.exists():
            return target
        try:
            directory.mkdir(parents=True, exist_ok=True)
            # Built under a private name and renamed: workers starting together never load half a file.
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=directory)
            os.close(fd)
        except OSError as e:
            errors.append(f"{directory}: {e}")
            continue
        try:
            compile_source(cxx, source, Path(tmp))
        except NativeKernelUnavailable:
            os.unlink(tmp)
            raise
        # mkstemp made the file private (0600; the linker adds x: 0711), which another user cannot load: the
        # container image builds its kernels as root and runs as user 10001. Readable by all, as g++ makes them.
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)
        log.info("native_kernel_built", kernel=name, path=str(target))
        return target
    raise NativeKernelUnavailable("no writable cache directory: " + "; ".join(errors))


def compile_source(cxx: str, source: Path, target: Path) -> None:
    """``source`` compiled into the shared library ``target``, against the generated ``tm_abi.h``."""
    with tempfile.TemporaryDirectory(prefix="tm-abi-") as include:
        (Path(include) / "tm_abi.h").write_text(abi.header())
        cmd = [cxx, *FLAGS, "-I", include, "-o", str(target), str(source)]
        result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        first = next((line for line in result.stderr.splitlines() if "error" in line), result.stderr.strip())
        raise NativeKernelUnavailable(f"{cxx} could not build {source.name}: {first}")


@functools.cache
def library(name: str) -> ctypes.CDLL | NativeKernelUnavailable:
    """The loaded library built from ``name``.cpp, or why it cannot be had (cached either way)."""
    if os.environ.get("TOKENMILL_NATIVE_KERNELS", "1") == "0":
        return NativeKernelUnavailable("TOKENMILL_NATIVE_KERNELS=0")
    cxx = shutil.which(os.environ.get("CXX", "g++"))
    if cxx is None:
        return NativeKernelUnavailable(f"no C++ compiler ({os.environ.get('CXX', 'g++')}) on PATH")
    try:
        return ctypes.CDLL(str(_build(name, cxx)))
    except NativeKernelUnavailable as e:
        return e
    except OSError as e:
        return NativeKernelUnavailable(str(e))


def unavailable_reason(name: str) -> str | None:
    """None when kernel ``name`` is ready; otherwise why it cannot be used on this machine."""
    lib = library(name)
    return str(lib) if isinstance(lib, NativeKernelUnavailable) else None


@functools.cache
def load(name: str) -> ctypes.CDLL:
    """Kernel ``name``'s library with its functions' types set from abi.py (or why it cannot be had)."""
    lib = library(name)
    if isinstance(lib, NativeKernelUnavailable):
        raise lib
    return abi.bind(lib, name)


def address(name: str, symbol: str) -> int:
    """The address of function ``symbol`` in kernel ``name``'s library, for native code that calls it."""
    value = ctypes.cast(getattr(load(name), symbol), ctypes.c_void_p).value
    assert value is not None
    return value
