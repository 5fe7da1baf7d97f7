"""Choosing the compute dtype: bfloat16 where the hardware does it natively, float32 elsewhere.

On a CPU with AVX512-BF16 or AMX, bfloat16 matrix products run three to four times faster than
float32 and read half the bytes; without them they are emulated and slower. Reference-exact
results (the test suite's comparisons with independent implementations) need float32 and no
quantization: --dtype float32 --quantization none.
"""

from __future__ import annotations

from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def cpu_has_native_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    try:
        text = cpuinfo.read_text()
    except OSError:
        return False
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(name: str, device: str, quantized: bool = False) -> torch.dtype:
    """'auto', 'float32' or 'bfloat16' -> the activation dtype to run the model in.

    ``auto`` with quantized weights is float32: the native kernel for GGUF blocks multiplies in
    float32 (and the int4/int8 kernels take it as two bfloat16 halves at about bfloat16's speed),
    and the results stay within the fidelity bounds, which plain bfloat16 activations do not. Unquantized weights: bfloat16 where native, else float32.
    """
    if name != "auto":
        return DTYPES[name]
    if quantized:
        return torch.float32
    if device.startswith("cuda"):
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def dtype_name(dtype: torch.dtype) -> str:
    return next(k for k, v in DTYPES.items() if v == dtype)
