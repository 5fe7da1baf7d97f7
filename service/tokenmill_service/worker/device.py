"""What the worker's device can run, probed once: the facts ``resolve_plan`` decides from.

Kept apart from the decision so that a test can hand ``resolve_plan`` a device that lacks
something (no C++ compiler, a kernel that does not build, no GPU) and read the reason it gives. Each
``*_missing`` field is None where the thing is there, else why it is not.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

# The native CPU kernels, by library name (worker/kernels/cpu/<name>.cpp).
NATIVE_KERNELS = (
    "block_gemm",
    "vnni_gemm",
    "kquant_gemm",
    "paged_attention",
    "latent_attention",
    "elementwise",
    "decoder_stack",
    "sampling",
)


@dataclass(frozen=True, slots=True)
class DeviceFacts:
    # "cpu" or "cuda:N": where the model's tensors live.
    device: str = "cpu"
    # Native kernel name -> why it cannot run here (absent: it can).
    native_missing: dict[str, str] = field(default_factory=dict)
    # Why Triton cannot run here (None: it can, on the GPU or in its interpreter).
    triton_missing: str | None = None
    # Triton runs in its CPU interpreter (TRITON_INTERPRET=1): float32 only.
    triton_interpreter: bool = False
    # Why torch.compile (inductor) cannot build here (None: it can).
    compiler_missing: str | None = None
    # The device multiplies bfloat16 natively (AVX512-BF16 or AMX on a CPU; a recent GPU).
    native_bf16: bool = False
    # On a CPU: the instruction set the native kernels are built for (contract/plan/cpu_isa.py), and why.
    cpu_isa: str = ""
    cpu_isa_reason: str = ""

    @property
    def kind(self) -> str:
        return self.device.split(":")[0]

    def native(self, *kernels: str) -> str | None:
        """None when every one of ``kernels`` can run here, else the first reason one cannot."""
        if self.kind != "cpu":
            return f"tokenmill's native kernels run on the CPU, and this model is on {self.device}"
        return next((self.native_missing[k] for k in kernels if k in self.native_missing), None)


def probe_device(device: str, compiler: bool = False, cpu_isa: str | None = None) -> DeviceFacts:
    """The facts of ``device`` ("cpu", "cuda", "cuda:N") on this machine. On a CPU this builds the
    native kernels (once per machine and instruction set, cached; a few seconds each the first time) for
    ``cpu_isa`` (``--cpu-isa``, which becomes this process's choice; None: the one already chosen). ValueError
    for an instruction set the CPU lacks. ``compiler``: also look for inductor's C++ compiler (importing
    inductor takes seconds: only for --compile auto)."""
    import torch

    from tokenmill_service.contract.plan import cpu_isa as isa
    from tokenmill_service.worker.dtypes import cpu_has_native_bf16

    if device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cuda:0"
    kind = device.split(":")[0]
    missing: dict[str, str] = {}
    isa_choice = None
    if kind == "cpu":
        from tokenmill_service.worker.kernels import build

        isa_choice = isa.use(cpu_isa) if cpu_isa is not None else isa.choose(os.environ.get(isa.ENV, "") or "auto")

        for name in NATIVE_KERNELS:
            if (reason := build.unavailable_reason(name)) is not None:
                missing[name] = reason
        native_bf16 = cpu_has_native_bf16()
    else:
        native_bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return DeviceFacts(
        device=device,
        native_missing=missing,
        triton_missing=triton_unavailable_reason(kind, torch.cuda.is_available()),
        triton_interpreter=interpreter_enabled(),
        compiler_missing=_inductor_compiler_missing() if kind == "cpu" and compiler else None,
        native_bf16=native_bf16,
        cpu_isa=isa_choice.name if isa_choice else "",
        cpu_isa_reason=isa_choice.reason if isa_choice else "",
    )


def _inductor_compiler_missing() -> str | None:
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        get_cpp_compiler()
    except Exception as exc:  # noqa: BLE001 - whatever inductor raises when it finds no compiler
        return f"no C++ compiler for inductor ({exc}); install g++ or set CXX"
    return None


# -- Triton: whether it can run here, decided before anything heavy is imported or loaded. It compiles
# its kernels for a GPU; without one it can still run them in its interpreter (TRITON_INTERPRET=1,
# NumPy on the CPU, slow, float32 only), which is for tests.


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
