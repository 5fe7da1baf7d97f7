"""The front door for model weights: find the checkpoint, plan how it runs here, build it, say so.

    options -> open_checkpoint (worker/models/checkpoint.py) -> probe_device + resolve_plan (plan/)
            -> build_model (worker/models/builder.py) -> the ``model_loaded`` log line with the plan

``load`` is what a worker runs; ``load_model`` is the same for code that has a path and keyword
arguments in hand (tests, benchmarks).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from pathlib import Path

import gguf
import structlog
import torch

from tokenmill_service.contract.model_paths import (
    DEFAULT_MODEL_INSTALL_HINT,
    ModelLoadError,
    ModelNotFoundError,
    resolve_model_path,
)
from tokenmill_service.contract.plan.options import LoadOptions
from tokenmill_service.contract.plan.plan import LoadPlan, PlanRefused
from tokenmill_service.worker.device import DeviceFacts, probe_device
from tokenmill_service.worker.distributed.parallel import TensorParallel
from tokenmill_service.worker.layers.fused_moe import FusedMoE
from tokenmill_service.worker.layers.linear import LinearBase
from tokenmill_service.worker.models.builder import build_model
from tokenmill_service.worker.models.checkpoint import Checkpoint, open_checkpoint
from tokenmill_service.worker.models.decoder import DecoderForCausalLM
from tokenmill_service.worker.models.resident_memory import release_freed_heap
from tokenmill_service.worker.plan.resolve import NATIVE_METHODS, dtype_name, resolve_plan, stored_bytes

log = structlog.get_logger(__name__)


def load(options: LoadOptions, device: str | None = None, tp: TensorParallel | None = None) -> DecoderForCausalLM:
    """The model ``options`` ask for, on ``device`` (default: ``options.device``), as this rank of ``tp``."""
    return load_planned(options, device, tp)[0]


def load_planned(
    options: LoadOptions,
    device: str | None = None,
    tp: TensorParallel | None = None,
    path: Path | None = None,
    reader: gguf.GGUFReader | None = None,
) -> tuple[DecoderForCausalLM, PlanInputs]:
    """``load``, and what its plan was made from (for ``replan``). ``path``: ``options.model`` already
    resolved, and ``reader``: its GGUF file already open, so that a process finds and opens it once."""
    start = time.perf_counter()
    path = path if path is not None else resolve_model_path(options.model or None)
    checkpoint = open_checkpoint(path, reader)
    try:
        facts = probe_device(device or options.device, compiler=options.compile == "auto", cpu_isa=options.cpu_isa)
    except ValueError as e:  # --cpu-isa names an instruction set this CPU lacks
        raise PlanRefused(str(e)) from None
    plan = resolve_plan(options, checkpoint, facts)
    _log_refusals(plan)
    model = build_model(plan, checkpoint, tp)
    _carry_out(plan, model)
    _warn_without_native_kernels(plan, checkpoint, model)
    checkpoint.release_pages()
    released = release_freed_heap()
    log.info(
        "model_loaded",
        name=checkpoint.config.name,
        path=str(path),
        format=checkpoint.format,
        dtype=str(model.act_dtype),
        device=plan.device,
        backend=options.backend,
        attention=plan.ops.value,
        layers="native stack" if plan.executor.value == "native-stack" else "python",
        kv_cache_dtype=plan.kv_cache_dtype.value,
        cpu_isa=facts.cpu_isa or None,
        quantization=options.quantization,
        linear_layers=plan.method_counts,
        kv_cache_bytes_per_token=int(plan.kv_cache_bytes_per_token.value),
        weight_bytes=model.weight_bytes(),
        weight_mib=round(model.weight_bytes() / 2**20, 1),
        seconds=round(time.perf_counter() - start, 3),
        heap_released_mib=released,
        plan=plan.summary(),
    )
    return model, PlanInputs(checkpoint, facts)


@dataclasses.dataclass(frozen=True, slots=True)
class PlanInputs:
    """What a model's plan was made from, kept to make it again without a choice that failed (``replan``)."""

    checkpoint: Checkpoint
    facts: DeviceFacts


def _carry_out(plan: LoadPlan, model: DecoderForCausalLM) -> None:
    """The plan's answers the built layers read: a mixture of experts' path."""
    one_call = plan.experts is not None and plan.experts.value == "native"
    for module in model.modules():
        if isinstance(module, FusedMoE):
            module.one_call = one_call


def replan(model: DecoderForCausalLM, inputs: PlanInputs, failed: Mapping[str, str]) -> LoadPlan:
    """The model's plan made again without the choices in ``failed`` (a choice -> what it raised while it ran:
    ``"compiled"`` when torch.compile failed); it becomes the model's plan, logged as ``plan_changed``. Only how
    the forward pass runs may change: the built layers stay as they are."""
    old = model.plan
    assert old is not None
    new = resolve_plan(old.options, inputs.checkpoint, inputs.facts, failed)
    if dataclasses.replace(new, executor=old.executor, skipped=old.skipped, experts=old.experts) != old:
        raise PlanRefused(f"a plan made without {', '.join(failed)} changes more than how the forward pass runs")
    _carry_out(new, model)
    model.plan = new
    log.warning(
        "plan_changed",
        failed=dict(failed),
        executor=new.executor.value,
        reason=new.executor.reason,
        **{f"skipped_{what}": why for what, why in new.skipped.items() if what in ("compile",)},
    )
    return new


def _log_refusals(plan: LoadPlan) -> None:
    """The faster choices this device could not take, each in the log line it has always had."""
    native = {m: why for m, why in plan.skipped.items() if m in NATIVE_METHODS}
    if native:
        log.info("native_kernel_skipped", reasons=native, instead=plan.method_counts)
    if plan.act_dtype.reason == "Triton's interpreter has no bfloat16":
        log.warning("triton_interpreter_float32", asked=plan.options.dtype, reason=plan.act_dtype.reason)
    if "compile" in plan.skipped:
        log.warning("compile_skipped", reason=plan.skipped["compile"], running=plan.executor.value)
    if plan.ops.value == "native" and plan.executor.value == "eager":
        log.info("native_stack_skipped", reason=plan.executor.reason)
    if plan.cpu_isa is not None and plan.cpu_isa.value == "scalar" and plan.options.cpu_isa == "auto":
        # The same bits as the vector builds, at a fraction of their speed: said once, where people look.
        log.warning("native_kernels_scalar", reason=plan.cpu_isa.reason)


# What to run to get a C++ compiler, for the warning below (the kernels build with g++, or $CXX).
COMPILER_INSTALL_HINT = (
    "install a C++ compiler (Debian/Ubuntu: apt-get install g++; Fedora: dnf install gcc-c++; "
    "macOS: xcode-select --install) and restart: the kernels build on first use, a few seconds each"
)
# Whether this process has warned that it serves without the native kernels (once, whatever it loads).
_warned_without_native = False


def _warn_without_native_kernels(plan: LoadPlan, checkpoint: Checkpoint, model: DecoderForCausalLM) -> None:
    """Once per process, at warning level: the model serves on a CPU without tokenmill's native kernels
    (no linear layer and no attention in them), what is missing, what it costs, and what to install."""
    global _warned_without_native
    if _warned_without_native or plan.device != "cpu" or plan.ops.value == "native":
        return
    missing = sorted({why for what, why in plan.skipped.items() if what in (*NATIVE_METHODS, "native-ops")})
    linear = [(name, m) for name, m in model.named_modules() if isinstance(m, LinearBase)]
    if not missing or any(m.quant.native_kernel is not None for _, m in linear):
        return
    _warned_without_native = True
    # The bytes of weights served (as model_loaded counts them), and as many with each linear layer the
    # native kernels would serve as the file stores it.
    config, types = checkpoint.config, checkpoint.tensor_types
    served = stored = model.weight_bytes()
    for name, m in linear:
        as_stored = stored_bytes(name, config, types, m.in_features * m.out_features)
        stored += 0 if as_stored is None else as_stored - m.quant.weight_bytes(m)
    # Measured on one thread: the embedded model's default decodes a step in 83 ms so, in 7 ms by gguf-vnni (README).
    cost = "torch's kernels and the layers one by one in Python (the embedded model's default decodes about 10 times slower)"
    if served > stored:
        cost += (
            f"; {served / 2**20:.0f} MiB of weights where the native kernels keep the file's "
            f"{stored / 2**20:.0f} MiB ({served / stored:.1f}x)"
        )
    if any("compiler" in why for why in missing):
        fix = COMPILER_INSTALL_HINT
    elif "TOKENMILL_NATIVE_KERNELS=0" in missing:
        fix = "unset TOKENMILL_NATIVE_KERNELS (=0 turns them off)"
    else:
        fix = "see missing"
    log.warning(
        "native_kernels_unavailable",
        missing="; ".join(missing),
        cost=cost,
        fix=fix,
        weight_mib=round(served / 2**20, 1),
        native_weight_mib=round(stored / 2**20, 1),
    )


def load_model(
    path: Path,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    quantization: str = "none",
    backend: str = "torch",
    tp: TensorParallel | None = None,
    kv_cache_dtype: str = "auto",
    compile: str = "off",
    max_loras: int = 0,
    max_lora_rank: int = 16,
    speculative_method: str = "ngram",
    max_model_len: int = 0,
) -> DecoderForCausalLM:
    """``load`` with the options as arguments; the defaults are the reference configuration
    (float32 activations, dense weights). ``tp.expert_parallel``: as ``--expert-parallel``;
    ``max_model_len``: as ``--max-model-len`` (0: the model's own context)."""
    options = LoadOptions(
        model=str(path),
        device=device.split(":")[0],
        dtype=dtype_name(dtype),
        quantization=quantization,
        backend=backend,
        kv_cache_dtype=kv_cache_dtype,
        compile=compile,
        tensor_parallel=tp.size if tp is not None else 1,
        expert_parallel=tp.expert_parallel if tp is not None else False,
        max_loras=max_loras,
        max_lora_rank=max_lora_rank,
        speculative_method=speculative_method,
        max_model_len=max_model_len,
    )
    return load(options, device, tp)


__all__ = [
    "DEFAULT_MODEL_INSTALL_HINT",
    "ModelLoadError",
    "ModelNotFoundError",
    "load",
    "load_model",
    "load_planned",
    "replan",
    "resolve_model_path",
]
