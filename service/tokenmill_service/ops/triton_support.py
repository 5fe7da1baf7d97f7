"""Whether the triton backend can run here, decided before anything heavy is imported or loaded.

Triton compiles its kernels for a GPU; on a machine without one it can still run them in its
interpreter (``TRITON_INTERPRET=1``, NumPy on the CPU, slow, float32 only), which is for tests.
"""

from __future__ import annotations

import os


def interpreter_enabled() -> bool:
    """Triton's own switch; read when a kernel is defined, so it must be set before the process starts."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def triton_unavailable_reason(device: str, gpu_visible: bool | None = None) -> str | None:
    """None when ``--backend triton`` can run on ``device``; otherwise what is wrong and what to use.
    ``gpu_visible``: whether torch sees a GPU (None: not known here, as in the torch-free server
    process, which checks the flags alone and leaves the GPU to the worker's plan)."""
    if interpreter_enabled():
        return None
    instead = (
        "use --backend torch, or set TRITON_INTERPRET=1 to run the triton kernels in Triton's CPU "
        "interpreter (slow, float32 only; for testing)"
    )
    if device != "cuda":
        return f"--backend triton needs a GPU (--device cuda) and --device is {device}: {instead}"
    if gpu_visible is False:
        return f"--backend triton needs a GPU and torch sees none: {instead}"
    return None
