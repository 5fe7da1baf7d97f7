"""The activation dtypes by name, and whether this CPU multiplies bfloat16 natively.

On a CPU with AVX512-BF16 or AMX, bfloat16 matrix products run three to four times faster than
float32 and read half the bytes; without them they are emulated and slower. The load plan
(worker/plan/resolve.py) chooses the dtype from these facts.
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


def dtype_name(dtype: torch.dtype) -> str:
    return next(k for k, v in DTYPES.items() if v == dtype)
