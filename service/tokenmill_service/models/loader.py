"""The front door for model weights: find the checkpoint, plan how it runs here, build it, say so.

    options -> open_checkpoint (models/checkpoint.py) -> probe_device + resolve_plan (plan/)
            -> build_model (models/builder.py) -> the ``model_loaded`` log line with the plan

``load`` is what a worker runs; ``load_model`` is the same for code that has a path and keyword
arguments in hand (tests, benchmarks).
"""

from __future__ import annotations

import time
from pathlib import Path

import structlog
import torch

from tokenmill_service.distributed.parallel import TensorParallel
from tokenmill_service.models.builder import build_model
from tokenmill_service.models.checkpoint import open_checkpoint
from tokenmill_service.models.llama import LlamaForCausalLM
from tokenmill_service.models.paths import (
    DEFAULT_MODEL_INSTALL_HINT,
    ModelLoadError,
    ModelNotFoundError,
    resolve_model_path,
)
from tokenmill_service.models.resident_memory import release_freed_heap
from tokenmill_service.plan.device import probe_device
from tokenmill_service.plan.options import LoadOptions
from tokenmill_service.plan.plan import LoadPlan, PlanRefused
from tokenmill_service.plan.resolve import NATIVE_METHODS, dtype_name, resolve_plan

log = structlog.get_logger(__name__)


def load(options: LoadOptions, device: str | None = None, tp: TensorParallel | None = None) -> LlamaForCausalLM:
    """The model ``options`` ask for, on ``device`` (default: ``options.device``), as this rank of ``tp``."""
    start = time.perf_counter()
    path = resolve_model_path(options.model or None)
    checkpoint = open_checkpoint(path)
    try:
        facts = probe_device(device or options.device, compiler=options.compile == "auto", cpu_isa=options.cpu_isa)
    except ValueError as e:  # --cpu-isa names an instruction set this CPU lacks
        raise PlanRefused(str(e)) from None
    plan = resolve_plan(options, checkpoint, facts)
    _log_refusals(plan)
    model = build_model(plan, checkpoint, tp)
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
    return model


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
) -> LlamaForCausalLM:
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
    "resolve_model_path",
]
