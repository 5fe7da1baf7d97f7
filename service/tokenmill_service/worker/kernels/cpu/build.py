"""Compiling and loading the native kernels: one shared library per C++ source in this folder and
instruction set.

Each source is written in simd.h's 16-lane ops and compiled once per machine and instruction set
(``g++ -O3 -fopenmp -ffp-contract=off -DTM_ISA_AVX2 -march=x86-64-v3``, a few seconds) into a cache
directory and loaded with ctypes; later processes load the cached library. Which instruction set a
process uses is instruction_sets.py's choice (``--cpu-isa``); every one gives the same bits. Every
source includes ``tm_abi.h``, generated from abi.py (the block table, the structs, each exported
function's prototype), and ``load`` types the library's functions from the same description, so a
C++ definition that disagrees with the Python side fails to compile. The cache key covers the
source, the headers, the flags and the compiler's version. Where a kernel cannot be built (no C++
compiler) ``unavailable_reason`` says why and the callers serve with torch's own kernels.
``TOKENMILL_NATIVE_KERNELS=0`` turns them all off.

OpenMP: the libraries link ``libgomp.so.1``, the soname torch's own OpenMP runtime has, so the
kernels share torch's thread pool rather than bringing a second one.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath

import structlog

from tokenmill_service.contract.plan import cpu_isa as instruction_sets
from tokenmill_service.worker.kernels.cpu import abi

log = structlog.get_logger(__name__)

HERE = Path(__file__).parent
# -ffp-contract=off: no a * b + c fused behind the source's back (simd.h's fmadd is the only fusing), so that
# every instruction set rounds where the scalar definition does.
FLAGS = ["-O3", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC", "-std=c++17"]


def isa_flags(isa: str) -> list[str]:
    """g++'s flags for instruction set ``isa``: its backend's macro and its -march."""
    return [f"-DTM_ISA_{isa.upper()}", *instruction_sets.BY_NAME[isa].flags]


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


def _includable(source: Path) -> list[Path]:
    """The headers a build of ``source`` finds, in the order of their paths: those beside it first (quoted
    includes look there before the -I folders), then this folder's. A source here (or a copy of this folder with
    the same headers) has the same ones, so the same key."""
    found = {PurePosixPath(h.relative_to(HERE).as_posix()): h for h in HERE.rglob("*.h")}
    if source.parent != HERE:
        found |= {PurePosixPath(h.relative_to(source.parent).as_posix()): h for h in source.parent.rglob("*.h")}
    return [found[k] for k in sorted(found)]


def library_name(name: str, cxx: str, isa: str, source: Path) -> str:
    """The cached library's file name: the kernel, the instruction set and a hash of all that makes the build."""
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False).stdout
    # What the source includes: the headers here and in isa/ (or beside another source, an earlier revision's
    # copy of this folder), and tm_abi.h, generated from abi.py.
    headers = [h.read_text() for h in _includable(source)] + [abi.header()]
    key = "\0".join([source.read_text(), *headers, " ".join(FLAGS + isa_flags(isa)), version])
    machine = "" if Path(cxx).name in ("g++", "c++") else f"{Path(cxx).name}-"  # a cross compiler's builds apart
    return f"{machine}{name}-{isa}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"


def _build(name: str, cxx: str, isa: str, source: Path | None = None) -> Path:
    source = source or HERE / f"{name}.cpp"
    target_name = library_name(name, cxx, isa, source)
    errors = []
    for directory in _cache_dirs():
        target = directory / target_name
        if target.exists():
            return target
        try:
            directory.mkdir(parents=True, exist_ok=True)
            lock = open(directory / f"{target_name}.lock", "a")  # noqa: SIM115 (held across the build below)
        except OSError as e:
            errors.append(f"{directory}: {e}")
            continue
        with lock:
            # One process builds a library at a time: workers (or test processes) starting together on a fresh
            # machine wait for the first one's build rather than each compiling the same source.
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not target.exists():
                _build_into(directory, target, name, cxx, isa, source)
        return target
    raise NativeKernelUnavailable("no writable cache directory: " + "; ".join(errors))


def _build_into(directory: Path, target: Path, name: str, cxx: str, isa: str, source: Path) -> None:
    # Built under a private name and renamed: a process never loads half a file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=directory)
    os.close(fd)
    try:
        compile_source(cxx, source, Path(tmp), isa)
    except NativeKernelUnavailable:
        os.unlink(tmp)
        raise
    # mkstemp made the file private (0600; the linker adds x: 0711), which another user cannot load: the
    # container image builds its kernels as root and runs as user 10001. Readable by all, as g++ makes them.
    os.chmod(tmp, 0o755)
    os.replace(tmp, target)
    log.info("native_kernel_built", kernel=name, isa=isa, path=str(target))


def compile_source(cxx: str, source: Path, target: Path, isa: str) -> None:
    """``source`` compiled for instruction set ``isa`` into the shared library ``target``, against the generated
    ``tm_abi.h`` (``cxx`` may be a cross compiler: the ARM64 checks build the neon kernels on x86)."""
    with tempfile.TemporaryDirectory(prefix="tm-abi-") as include:
        (Path(include) / "tm_abi.h").write_text(abi.header())
        cmd = [cxx, *FLAGS, *isa_flags(isa), "-I", include, "-I", str(HERE), "-o", str(target), str(source)]
        result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        first = next((line for line in result.stderr.splitlines() if "error" in line), result.stderr.strip())
        raise NativeKernelUnavailable(f"{cxx} could not build {source.name}: {first}")


def built(name: str, isa: str, cxx: str | None = None, source: Path | None = None) -> Path:
    """The path of kernel ``name``'s library for ``isa``, built if it is not yet, cached as the server's are
    (NativeKernelUnavailable if it cannot be): for the checks that load two instruction sets' builds side by side.
    ``cxx``: another compiler (a cross compiler: the ARM64 checks); ``source``: another source than ``name``.cpp."""
    found = shutil.which(cxx or os.environ.get("CXX", "g++"))
    if found is None:
        raise NativeKernelUnavailable(f"no C++ compiler ({cxx or os.environ.get('CXX', 'g++')}) on PATH")
    return _build(name, found, isa, source)


def prebuild(isas: Sequence[str] | None = None, jobs: int | None = None) -> dict[str, str]:
    """Builds every kernel for every instruction set of this machine's architecture (or those in ``isas``),
    whether this CPU runs it or not (a container image is built on one CPU and run on others), ``jobs`` compilers
    at a time (default: one a core): "kernel/isa" -> the library's path, or why it could not be built."""
    names = sorted(p.stem for p in HERE.glob("*.cpp"))
    if isas is None:
        isas = [s.name for s in instruction_sets.INSTRUCTION_SETS if s.machine in (None, instruction_sets.machine())]
    # The slowest first (the plain C++ builds of the large kernels), so that no long build starts last.
    order = sorted(((n, i) for n in names for i in isas), key=lambda pair: pair[1] != "scalar")

    def one(pair: tuple[str, str]) -> str:
        try:
            return str(built(*pair))
        except NativeKernelUnavailable as e:
            return str(e)

    with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as pool:
        return {f"{n}/{i}": out for (n, i), out in zip(order, pool.map(one, order), strict=True)}


def library(name: str, isa: str | None = None) -> ctypes.CDLL | NativeKernelUnavailable:
    """The loaded library built from ``name``.cpp for ``isa`` (None: this process's, instruction_sets.selected()),
    or why it cannot be had (cached either way)."""
    return _library(name, isa or instruction_sets.selected())


@functools.cache
def _library(name: str, isa: str) -> ctypes.CDLL | NativeKernelUnavailable:
    if os.environ.get("TOKENMILL_NATIVE_KERNELS", "1") == "0":
        return NativeKernelUnavailable("TOKENMILL_NATIVE_KERNELS=0")
    if (why := instruction_sets.missing(isa)) is not None:
        return NativeKernelUnavailable(f"the {isa} kernels cannot run here: {why}")
    cxx = shutil.which(os.environ.get("CXX", "g++"))
    if cxx is None:
        return NativeKernelUnavailable(f"no C++ compiler ({os.environ.get('CXX', 'g++')}) on PATH")
    try:
        return ctypes.CDLL(str(_build(name, cxx, isa)))
    except NativeKernelUnavailable as e:
        return e
    except OSError as e:
        return NativeKernelUnavailable(str(e))


def unavailable_reason(name: str, isa: str | None = None) -> str | None:
    """None when kernel ``name`` is ready; otherwise why it cannot be used on this machine."""
    lib = library(name, isa)
    return str(lib) if isinstance(lib, NativeKernelUnavailable) else None


def load(name: str, isa: str | None = None) -> ctypes.CDLL:
    """Kernel ``name``'s library for ``isa`` (None: this process's) with its functions' types set from abi.py (or
    why it cannot be had)."""
    return _load(name, isa or instruction_sets.selected())


@functools.cache
def _load(name: str, isa: str) -> ctypes.CDLL:
    lib = _library(name, isa)
    if isinstance(lib, NativeKernelUnavailable):
        raise lib
    return abi.bind(lib, name)


def address(name: str, symbol: str, isa: str | None = None) -> int:
    """The address of function ``symbol`` in kernel ``name``'s library, for native code that calls it."""
    value = ctypes.cast(getattr(load(name, isa), symbol), ctypes.c_void_p).value
    assert value is not None
    return value
