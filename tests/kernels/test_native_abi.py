"""The native ABI is written once (worker/kernels/cpu/abi.py): the C++ compiles against a header generated from
it, the ctypes bindings are derived from it, and a disagreement stops the build."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QType

from tokenmill_service.worker.kernels.cpu import abi, block_gemm, build
from tokenmill_service.worker.layers.quant.blocks import GGUFBlocksMethod
from tokenmill_service.worker.layers.quant.gguf_blocks import BLOCK_BYTES, BLOCK_WEIGHTS, QUANT_BLOCK

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler")

AGREEING = """#include "tm_abi.h"
extern "C" int tm_block_dequantize(int fmt, const uint8_t* w, int64_t n, int64_t k, float* out) { return 0; }
"""


def test_a_definition_that_disagrees_with_the_abi_does_not_compile(tmp_path: Path) -> None:
    source = tmp_path / "agrees.cpp"
    source.write_text(AGREEING)
    build.compile_source("g++", source, tmp_path / "agrees.so", "scalar")  # the control: it builds
    # One parameter's type changed (int64_t k -> int k): C linkage has no overloads, so g++ refuses.
    source = tmp_path / "disagrees.cpp"
    source.write_text(AGREEING.replace("int64_t k", "int k"))
    with pytest.raises(build.NativeKernelUnavailable, match="could not build disagrees.cpp: .*conflicting declaration"):
        build.compile_source("g++", source, tmp_path / "disagrees.so", "scalar")


def test_a_struct_laid_out_otherwise_than_ctypes_sees_it_does_not_compile(tmp_path: Path) -> None:
    """The header asserts each struct's size and offsets as ctypes computes them."""
    header = abi.header()
    offset = abi.structure("TmStack").eps.offset
    assert f"offsetof(TmStack, eps) == {offset}" in header
    source = tmp_path / "moved.cpp"
    source.write_text('#include "tm_abi.h"\n')
    build.compile_source("g++", source, tmp_path / "ok.so", "scalar")
    include = tmp_path / "include"
    include.mkdir()
    (include / "tm_abi.h").write_text(header.replace("  float eps;\n  float scale;", "  float scale;\n  double eps;"))
    result = subprocess.run(
        ["g++", "-std=c++17", "-fsyntax-only", "-I", str(include), str(source)],
        check=False,
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0 and "offset differs" in result.stderr


def test_the_bindings_are_typed_from_the_abi() -> None:
    lib = build.load("block_gemm")
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    assert lib.tm_block_gemm.argtypes == [ctypes.c_int, ptr, i64, i64, ptr, i64, ptr, ctypes.c_int]
    assert lib.tm_block_gemm.restype is ctypes.c_int
    assert [name for name, _ in abi.structure("TmLinear")._fields_][:4] == ["gemm", "weights", "fmt", "out_features"]


def test_one_block_table_for_python_and_cpp() -> None:
    assert QUANT_BLOCK == abi.QUANT_BLOCK == 32
    header = abi.header()
    for fmt in abi.BLOCK_FORMATS:
        assert f"#define TM_BLOCK_WEIGHTS_{fmt.name} {fmt.block_weights}" in header
        assert f"#define TM_BLOCK_BYTES_{fmt.name} {fmt.block_bytes}" in header
        if fmt.name != "F32":
            # gguf's own table: (weights per block, bytes per block), and ggml's type id.
            assert GGML_QUANT_SIZES[QType[fmt.name]] == (fmt.block_weights, fmt.block_bytes)
            assert QType[fmt.name] == fmt.id
            assert BLOCK_BYTES[QType[fmt.name]] == fmt.block_bytes
            assert BLOCK_WEIGHTS[QType[fmt.name]] == fmt.block_weights


def test_the_kernels_name_the_formats_and_their_block_sizes_from_the_one_table(tmp_path: Path) -> None:
    """The generated header names every format (TmFormat) and gives each family of kernels the block sizes of its
    own formats, 0 for the others, as the table says; no kernel source writes the formats out again."""
    checks = []
    for f in abi.BLOCK_FORMATS:
        native, kquant = (f.block_bytes if f.kernel == kernel else 0 for kernel in ("blocks", "kquant"))
        checks += [
            f'static_assert({f.name} == {f.id}, "{f.name}: its id");',
            f'static_assert(tm_native_block_bytes({f.name}) == {native}, "{f.name}: native block bytes");',
            f'static_assert(tm_kquant_block_bytes({f.name}) == {kquant}, "{f.name}: k-quant block bytes");',
        ]
    source = tmp_path / "formats.cpp"
    source.write_text('#include "tm_abi.h"\n' + "\n".join(checks) + "\n")
    build.compile_source("g++", source, tmp_path / "formats.so", "scalar")  # a false static_assert stops it
    for path in [*build.HERE.glob("*.cpp"), *build.HERE.glob("*.h")]:
        assert "TM_FORMAT_" not in path.read_text(), f"{path.name} names a format by hand: use TmFormat's names"


def test_the_native_kernels_read_only_the_formats_they_have_code_for() -> None:
    """The table holds every format tokenmill dequantizes; the kernels keep to their own rows of it."""
    assert block_gemm.FORMATS == {f.id: f.block_bytes for f in abi.BLOCK_FORMATS if f.kernel == "blocks"}
    formats = [QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1, QType.Q8_0, QType.IQ4_NL, QType.MXFP4]
    assert sorted(block_gemm.FORMATS) == [0, *sorted(int(q) for q in formats)]
    assert GGUFBlocksMethod.served_types == set(formats)
    assert all(f.block_weights == QUANT_BLOCK for f in abi.BLOCK_FORMATS if f.kernel == "blocks")
    assert "static_assert(TM_BLOCK_WEIGHTS_Q4_0 == TM_QK" in abi.header()
    assert "TM_BLOCK_WEIGHTS_Q4_K == TM_QK" not in abi.header()
    # A k-quant is in the table, not in the kernels: they refuse its id before reading a byte.
    with pytest.raises(ValueError, match="ggml type 12 is not a block format the native kernel reads"):
        block_gemm.block_dequantize(torch.zeros(2, 1, 144, dtype=torch.uint8), int(QType.Q4_K))
