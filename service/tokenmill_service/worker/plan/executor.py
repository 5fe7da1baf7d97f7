"""How a forward pass runs, decided by the plan: the executor (the model's loop, the native decoder stack,
or compiled regions) and a mixture of experts' path (one call a layer, or one by one).

Each answer comes with its reason, from what was asked, the device's facts, each linear layer's
method and the family's declared facts (its classes' seams: a layer that does more than the stack
computes, an MLP activation, a latent cache). Nothing after the plan asks again: the runner builds the
executor the plan names and the experts' layers run the way it says. A choice that fails while it
runs (torch.compile raising at warm-up) comes back as ``failed``: the plan is made again without it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from tokenmill_service.contract.plan.options import LoadOptions
from tokenmill_service.contract.plan.plan import Decision, LayerChoice
from tokenmill_service.worker.device import DeviceFacts
from tokenmill_service.worker.kernels import Ops
from tokenmill_service.worker.layers.quant import quant_method_class
from tokenmill_service.worker.layers.quant.gguf_blocks import QUANT_BLOCK
from tokenmill_service.worker.models.config import ModelConfig
from tokenmill_service.worker.models.spec import FamilySpec


@dataclass(frozen=True, slots=True)
class ForwardInputs:
    """What the executor and the experts' path are chosen from: what was asked, the device's facts, the ops
    backend and activations' dtype chosen, each linear layer's method and kernel, the family and its config."""

    options: LoadOptions
    facts: DeviceFacts
    ops: type[Ops]
    act: torch.dtype
    layers: Mapping[str, LayerChoice]
    family: FamilySpec
    config: ModelConfig


def executor(
    inputs: ForwardInputs, experts: Decision | None, skipped: dict[str, str], failed: Mapping[str, str]
) -> Decision:
    options, family = inputs.options, inputs.family
    if options.compile == "auto" and options.max_loras > 0:
        # The adapters' grouped products change shape with the step's adapters: not inside the regions.
        skipped["compile"] = "LoRA adapters (--max-loras) are not run inside compiled regions"
    elif options.compile == "auto":
        why = family.facts.compile_gap or compile_missing(options, inputs.facts, inputs.ops)
        if why is None and "compiled" in failed:
            why = f"torch.compile failed while building the graphs ({failed['compiled']})"
        if why is None:
            return Decision("compiled", "asked (--compile auto)")
        skipped["compile"] = why
    why = native_stack_missing(inputs)
    if why is None and experts is not None and experts.value != "native":
        why = f"a mixture of experts' layers run their experts one by one ({experts.reason})"
    if why is None and "native-stack" in failed:
        why = f"building it failed ({failed['native-stack']})"
    if why is None:
        return Decision("native-stack", "every part of the decoder has a native kernel: one native call a step")
    return Decision("eager", f"the model's layers one by one: no native stack, as {why}")


def experts_path(inputs: ForwardInputs) -> Decision | None:
    """How a mixture-of-experts model's experts run (None: it has none): one native call a layer
    (``Ops.moe_experts`` with the experts' packed weights, worker/kernels/cpu/moe_mlp.cpp) or one by one."""
    options, ops, layers, config = inputs.options, inputs.ops, inputs.layers, inputs.config
    if not config.extra_int("num_experts"):
        return None
    why: str | None
    if ops.name != "native":
        why = f"the {ops.name} ops run them through the linear layers"
    elif inputs.act != torch.float32:
        why = "the native call takes float32 activations"
    elif options.max_loras > 0:
        why = "LoRA adapters on experts run through the linear layers (--max-loras)"
    elif gap := inputs.family.facts.native_experts_gap:
        why = gap
    else:
        why = next(
            (
                f"an expert's {choice.method} weights have no native kernel"
                for prefix, choice in layers.items()
                if ".experts." in prefix and choice.kernel not in quant_method_class(choice.method).native_entry_points
            ),
            None,
        ) or (_dense_expert_gap(options, layers, config) or inputs.facts.native("moe_mlp", "elementwise"))
    if why is None:
        return Decision("native", "one native call a layer: the experts' products, activation and combine")
    return Decision("one-by-one", why)


def _dense_expert_gap(options: LoadOptions, layers: Mapping[str, LayerChoice], config: ModelConfig) -> str | None:
    """Dense experts multiply in the native float32 product only where a rank's slice of their inputs is whole
    blocks of 32 (worker/layers/quant/dense.py takes the sliced torch product otherwise): why not, or None."""
    ranks = 1 if options.expert_parallel else options.tensor_parallel
    for prefix, choice in layers.items():
        if ".experts." not in prefix or choice.method != "none":
            continue
        down = prefix.endswith("down_proj")
        columns = config.extra_int("expert_width") // ranks if down else config.hidden_size
        if columns % QUANT_BLOCK:
            return (
                f"an expert's {'down' if down else 'gate/up'} projection takes {columns} inputs on a rank, not whole "
                f"blocks of {QUANT_BLOCK} for the native float32 product"
            )
    return None


def compile_missing(options: LoadOptions, facts: DeviceFacts, ops: type[Ops]) -> str | None:
    """Why ``--compile auto`` leaves this worker eager, or None when it compiles."""
    if not ops.compilable:
        return f"the {ops.name} backend runs its own kernels"
    if options.tensor_parallel > 1:
        return "tensor-parallel ranks run eager (collectives inside compiled regions are not supported yet)"
    if facts.kind != "cpu":
        return f"compiling for {facts.kind} (CUDA graphs) is not implemented yet"
    return facts.compiler_missing


def native_stack_missing(inputs: ForwardInputs) -> str | None:
    """Why the decoder layers cannot run as one native call, or None when they can."""
    options, family, config = inputs.options, inputs.family, inputs.config
    if inputs.ops.name != "native":
        return "attention is not tokenmill's native kernel"
    if options.tensor_parallel > 1:
        return "tensor-parallel ranks all-reduce between the layers"
    if inputs.act != torch.float32:
        return "it runs float32 activations"
    if (gap := _family_gap(family, config)) is not None:
        return gap
    # Projection biases, sliding windows (with their KV-cache groups) and attention sinks ride in the stack;
    # a projection the family absorbs at load (DeepSeek's kv_b_proj) is never applied by its kernel.
    absorbed = family.tensors.absorbed
    for prefix, choice in inputs.layers.items():
        leaf = prefix.rpartition(".")[2]
        if prefix == "lm_head" or leaf in absorbed:
            continue
        if choice.kernel not in quant_method_class(choice.method).native_entry_points:
            return f"the {leaf.removesuffix('_proj')} projection is {choice.method}, which has no native kernel to call"
    # LoRA adapters (--max-loras) ride in the stack through lora.cpp's kernel; latent attention's take no adapters.
    lora = ("lora",) if options.max_loras > 0 else ()
    latent: tuple[str, ...] = ()
    if family.facts.latent_attention:
        if options.max_loras > 0:
            return "LoRA adapters on latent attention run through the linear layers (--max-loras)"
        if (gap := family.latent_stack_gap(config)) is not None:
            return str(gap)
        latent = ("latent_attention",)
    # A mixture of experts: the router's product, softmax top-k and the experts in moe_mlp.cpp's calls.
    experts: tuple[str, ...] = ()
    if config.extra_int("num_experts"):
        if options.max_loras > 0:
            return "LoRA adapters on experts run through the linear layers (--max-loras)"
        if gap := family.facts.native_experts_gap:
            return gap
        experts = ("moe_mlp",)
    return inputs.facts.native("decoder_stack", "paged_attention", "elementwise", *lora, *experts, *latent)


def _family_gap(family: FamilySpec, config: ModelConfig) -> str | None:
    """What the family's layers do that the stack does not (None: nothing), from its spec's facts and its
    declared layer class: the stack runs the decoder's layer with the family's norms, q/k norms, windows, sinks,
    soft cap, rotary tables, one MLP activation and one residual multiplier, and would silently skip anything
    more."""
    name, facts = config.architecture, family.facts
    if facts.native_stack_gap:
        return f"the {name} family has no native stack: {facts.native_stack_gap}"
    # A layer overriding the decoder layer's ``branch`` does more than the multiplier (by name: the plan
    # imports no compute module).
    if family.module.layer_type.branch.__qualname__ != "DecoderLayer.branch":
        return f"the {name} family's layers do more to a sub-layer's output than the stack's residual multiplier"
    if facts.residual_multiplier and facts.norms == "sandwich":
        return "a sandwich-normed layer's regions scale no branch; the stack would scale them"
    if facts.latent_attention and facts.activation != "silu":
        return "the native stack's latent layers run SiLU-and-mul MLPs"
    if facts.latent_attention and facts.residual_multiplier:
        return "the native stack's latent layers scale no sub-layer's output"
    return None
