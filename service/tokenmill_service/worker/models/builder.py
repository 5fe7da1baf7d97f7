"""Building a model from a load plan and a checkpoint: the family's module on the plan's device,
each linear layer with the method and kernel the plan chose for it, the weights loaded in place.

Nothing here decides anything: the plan (worker/plan/resolve.py) has, and this carries it out.
"""

from __future__ import annotations

import dataclasses

import torch

from tokenmill_service.contract.model_paths import ModelLoadError
from tokenmill_service.contract.plan.plan import LoadPlan
from tokenmill_service.worker.distributed.parallel import TensorParallel
from tokenmill_service.worker.dtypes import DTYPES
from tokenmill_service.worker.kernels import get_ops
from tokenmill_service.worker.layers.embedding import VocabParallelEmbedding
from tokenmill_service.worker.layers.quant import QuantMethod, quant_method_class
from tokenmill_service.worker.models.checkpoint import Checkpoint
from tokenmill_service.worker.models.decoder import DecoderForCausalLM
from tokenmill_service.worker.models.registry import family

# The dtypes a plan names for the KV cache and the adapter slots.
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def build_model(plan: LoadPlan, checkpoint: Checkpoint, tp: TensorParallel | None = None) -> DecoderForCausalLM:
    """A ready-to-run model (eval mode, no gradients): the plan carried out on the checkpoint."""
    config, spec = checkpoint.config, family(plan.architecture)
    if plan.rope is not None:  # the rotary factors the plan chose for the served context
        config = spec.with_rope(config, plan.rope.value)
    act_dtype = DTYPES[plan.act_dtype.value]
    tp = dataclasses.replace(tp or TensorParallel(), expert_parallel=plan.options.expert_parallel)

    def quant(prefix: str) -> QuantMethod:
        choice = plan.quant_method(prefix)
        return quant_method_class(choice.method)(act_dtype, choice.kernel)

    # Built on the target device, so that each layer packs its weights for the kernel it will run.
    with torch.device(plan.device):
        model = spec.module(
            config,
            get_ops(plan.ops.value),
            quant,
            act_dtype=act_dtype,
            # "gguf-blocks": rows of float32, looked up from the file's blocks (worker/layers/embedding.py).
            embed_dtype=DTYPES.get(plan.embed_dtype, torch.float32),
            tp=tp,
        )
        if plan.options.speculative_method == "mtp":
            model.attach_mtp(quant)  # the draft model: the checkpoint's multi-token-prediction layers
    for module in model.modules():
        if isinstance(module, VocabParallelEmbedding):
            module.keep_blocks = plan.embed_dtype == "gguf-blocks"
    try:
        model.load_weights(checkpoint.tensors)
    except (ValueError, RuntimeError) as e:
        raise ModelLoadError(f"{checkpoint.path}: weights do not fit the configuration: {e}") from e
    model.kv_dtype = TORCH_DTYPES[plan.kv_cache_dtype.value]
    model.quantization = plan.quantization
    model.plan = plan
    if plan.options.max_loras > 0:
        from tokenmill_service.worker.layers.lora import attach_lora

        with torch.device(plan.device):
            attach_lora(model, plan.options.max_loras, plan.options.max_lora_rank, TORCH_DTYPES[plan.lora_dtype.value])
    model.eval()
    model.requires_grad_(False)
    if not isinstance(model, DecoderForCausalLM):  # every family's module is one (the spec's type is untyped)
        raise TypeError(f"the {plan.architecture!r} family's {type(model).__name__} is not a DecoderForCausalLM")
    return model
