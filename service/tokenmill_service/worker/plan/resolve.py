"""``resolve_plan``: what the user asked, the checkpoint and the device's facts -> the load plan.

Every choice about how a model runs is made here, once, each with its reason: the activations'
dtype, each linear layer's method and kernel (asking the registered methods where they run), the
ops backend (asking the registered backends), the KV cache's dtype and layout (the backend's), and
the executor and a mixture of experts' path (worker/plan/executor.py). A refusal raises
``PlanRefused`` saying why and what would run.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from gguf import GGMLQuantizationType as QType

from tokenmill_service.contract.model_dims import ModelDims, largest_block
from tokenmill_service.contract.parallel_degree import check_degree
from tokenmill_service.contract.plan import choices
from tokenmill_service.contract.plan.options import LoadOptions
from tokenmill_service.contract.plan.plan import Decision, LayerChoice, LoadPlan, PlanRefused
from tokenmill_service.worker.device import DeviceFacts
from tokenmill_service.worker.dtypes import DTYPES
from tokenmill_service.worker.kernels import Ops, ops_class
from tokenmill_service.worker.layers.quant import quant_method_class
from tokenmill_service.worker.layers.quant.gguf_blocks import BLOCK_BYTES, BLOCK_WEIGHTS
from tokenmill_service.worker.models.checkpoint import Checkpoint
from tokenmill_service.worker.models.config import ModelConfig
from tokenmill_service.worker.models.deepseek_mtp import mtp_checkpoint_prefix
from tokenmill_service.worker.models.registry import family
from tokenmill_service.worker.models.spec import FamilySpec
from tokenmill_service.worker.plan.executor import ForwardInputs, experts_path
from tokenmill_service.worker.plan.executor import executor as choose_executor

# The kernels that take 8-bit activations (--activations int8), by the kernel they replace.
INT8_KERNELS = {"vnni_gemm": "vnni_gemm_int8", "kquant_gemm": "kquant_gemm_int8"}
# The methods that multiply a GGUF's blocks as stored, with tokenmill's native CPU kernels, fastest first
# (each serves its own formats: a layer gets the first available one that serves how it is stored).
NATIVE_METHODS = ("gguf-vnni", "gguf-kquant", "gguf")
_INT4_TYPES = {QType.Q4_0, QType.Q4_1}
# The method that serves FP8 block-scaled safetensors as stored (worker/layers/quant/fp8_block.py).
FP8_METHOD = "fp8-block"
# Checkpoint projections each packed layer is made of.
_PACKED_SOURCES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def resolve_plan(
    options: LoadOptions, checkpoint: Checkpoint, facts: DeviceFacts, failed: Mapping[str, str] | None = None
) -> LoadPlan:
    """``failed``: choices that failed while they ran (``"compiled"``: torch.compile raised), with what they
    raised; the plan is made without them and says so."""
    failed = failed or {}
    config, types = checkpoint.config, checkpoint.tensor_types
    spec = family(config.architecture)
    if (why := spec.unserved_reason(config)) is not None:
        raise PlanRefused(why)
    _check_choices(options)
    if options.quantization != "auto":
        quant_method_class(options.quantization)  # an unknown name fails here, before anything else
    ops_cls = ops_class("native" if options.backend == "torch" else options.backend)
    fp8: frozenset[str] = config.extra.get("fp8_weights", frozenset())  # type: ignore[assignment]
    if options.quantization == FP8_METHOD and not fp8:
        raise PlanRefused(f"--quantization {FP8_METHOD} serves FP8 block-scaled weights; {checkpoint.path} has none")
    act = _activations(options, bool(types) or bool(fp8), facts)
    act_dtype = DTYPES[act.value]
    prefixes = spec.tensors.linear_prefixes(config) + _mtp_prefixes(options, spec, config)
    layers, quant_reasons, skipped = _linear_layers(options, prefixes, checkpoint, facts, act_dtype)
    activations = _activations_precision(options, layers, config)
    _check_tensor_parallel(options, config, types)
    ops = _ops(options, ops_cls, facts, act_dtype, config.head_dim, skipped)
    ops_cls = ops_class(ops.value)
    kv = _kv_cache_dtype(options.kv_cache_dtype, act_dtype, ops_cls, facts, config.head_dim)
    layout = _kv_cache_layout(spec, ops_cls, config)
    forward = ForwardInputs(options, facts, ops_cls, act_dtype, layers, spec, config)
    experts = experts_path(forward)
    executor = choose_executor(forward, experts, skipped, failed)
    # A GGUF's blocks under auto are quantized weights even where no native kernel serves and every layer
    # is dense: the embedding table stays as stored then too, only the looked-up rows dequantized.
    quantized = any(c.method != "none" for c in layers.values()) or (
        options.quantization == "auto" and any(t in BLOCK_WEIGHTS for t in types.values())
    )
    return LoadPlan(
        options=options,
        device=facts.device,
        architecture=config.architecture,
        act_dtype=act,
        embed_dtype=_embedding(quantized, act.value, types, facts),
        ops=ops,
        kv_cache_dtype=kv,
        kv_cache_layout=layout,
        executor=executor,
        experts=experts,
        layers=layers,
        quant_reasons=quant_reasons,
        tensor_parallel=options.tensor_parallel,
        kv_cache_bytes_per_token=kv_cache_bytes_per_token(
            spec, config, kv.value, options.tensor_parallel, int(options.speculative_method == "mtp")
        ),
        skipped=skipped,
        lora_dtype=_lora_dtype(options, facts),
        rope=_rope(spec, config, options.max_model_len),
        cpu_isa=Decision(facts.cpu_isa, facts.cpu_isa_reason) if facts.cpu_isa else None,
        activations=activations,
    )


def _rope(spec: FamilySpec, config: ModelConfig, max_model_len: int) -> Decision | None:
    """The family's rotary scaling for the served context, where it depends on it (LongRoPE's factors)."""
    chosen = None if spec.rope_choice is None else spec.rope_choice(config, max_model_len)
    return None if chosen is None else Decision(*chosen)


def _check_choices(options: LoadOptions) -> None:
    """Each enumerated option one of its values (contract/plan/choices.py); --quantization and --backend name a
    registered implementation (or auto), checked where they are looked up."""
    try:
        choices.KV_CACHE_DTYPE.check(options.kv_cache_dtype)
        choices.ACTIVATIONS.check(options.activations)
        choices.COMPILE.check(options.compile)
        choices.SPECULATIVE_METHOD.check(options.speculative_method)
    except ValueError as e:
        raise PlanRefused(str(e)) from None


def _activations_precision(
    options: LoadOptions, layers: dict[str, LayerChoice], config: ModelConfig
) -> Decision | None:
    """What the integer-product kernels round the activations to (None: no layer has them). Under
    --activations int8 their layers take the int8 kernels (``layers`` rewritten in place), or the plan refuses."""
    integer = [prefix for prefix, choice in layers.items() if choice.kernel in INT8_KERNELS]
    if options.activations == "auto":
        if not integer:
            return None
        return Decision("16-bit", "fixed point per block of 32 (--activations auto): logprobs within about 1e-3")
    if not integer:
        methods = ", ".join(sorted({c.method for c in layers.values()}))
        raise PlanRefused(
            "--activations int8 needs tokenmill's native integer-product kernels (--quantization gguf-vnni or "
            f"gguf-kquant on a GGUF's blocks, on a CPU), and no layer of this plan has them (methods: {methods})"
        )
    if config.extra_int("num_experts"):
        raise PlanRefused(
            "--activations int8 does not serve mixture-of-experts models: their experts' kernel has no int8 form"
        )
    for prefix in integer:
        choice = layers[prefix]
        layers[prefix] = LayerChoice(choice.method, INT8_KERNELS[choice.kernel])
    return Decision(
        "int8",
        f"asked (--activations int8): 8-bit per block of 32 as llama.cpp's Q8_0, {len(integer)} of {len(layers)} "
        "linear layers; less precise than 16-bit",
    )


def _lora_dtype(options: LoadOptions, facts: DeviceFacts) -> Decision:
    """What adapter slots store: 16 bits (half the bytes a mixed-adapter step reads), or float32 when asked."""
    if options.max_loras == 0:
        return Decision("float32", "no adapter slots")
    if options.dtype == "float32":
        return Decision("float32", "asked (--dtype float32)")
    if options.backend == "triton" and facts.triton_interpreter:
        return Decision("float32", "Triton's interpreter has no bfloat16")
    return Decision("bfloat16", "adapter weights in 16 bits, products accumulated in float32")


def _kv_cache_layout(spec: FamilySpec, ops: type[Ops], config: ModelConfig) -> str:
    """The backend's cache layout for this family: keys and values per head, or a latent per token."""
    if not spec.facts.latent_attention:
        return ops.kv_cache_layout.name
    if ops.latent_cache_layout is None:
        raise PlanRefused(
            f"--backend {ops.name} has no multi-head latent attention, which the {config.architecture} family needs "
            "(the torch backend has it)"
        )
    return ops.latent_cache_layout.name


def kv_cache_bytes_per_token(
    spec: FamilySpec, config: ModelConfig, kv_dtype: str, tensor_parallel: int, draft_layers: int = 0
) -> Decision:
    """Bytes of cache a token of context takes on a rank, with what they are and, for a family that
    caches less than keys and values per head, its saving against such a cache; ``draft_layers``: the
    draft model's layers cached beside the decoder's (``--speculative-method mtp``), as many more layers."""
    values, per_head = spec.kv_cache_values_per_token(config, tensor_parallel)
    if draft_layers:
        layers = config.num_layers
        values, per_head = values * (layers + draft_layers) // layers, per_head * (layers + draft_layers) // layers
    elem = torch.empty((), dtype=getattr(torch, kv_dtype)).element_size()
    if values == per_head:
        reason = f"{values} {kv_dtype} values: a key and a value per layer and key/value head"
    else:
        reason = (
            f"{values} {kv_dtype} values: one latent and one rotary key per layer, shared by the heads; "
            f"a per-head cache would take {per_head * elem} bytes ({per_head / values:.1f}x)"
        )
    if draft_layers:
        reason += f"; the multi-token-prediction layer's {draft_layers} among the layers"
    return Decision(str(values * elem), reason)


def _embedding(quantized: bool, act: str, types: dict[str, QType], facts: DeviceFacts) -> str:
    """How the embedding table is kept. With quantized weights its rows stay exact (float32): on a CPU,
    a GGUF's block-quantized table as the file stores it, only the looked-up rows dequantized exactly
    ("gguf-blocks": the values of a float32 table at the file's size, the file's pages never copied)."""
    if not quantized:
        return act
    if facts.kind == "cpu" and types.get("model.embed_tokens.weight") in BLOCK_WEIGHTS:
        return "gguf-blocks"
    return "float32"


def _activations(options: LoadOptions, gguf: bool, facts: DeviceFacts) -> Decision:
    """``gguf``: the checkpoint's weights are quantized as stored (GGUF blocks, FP8 blocks)."""
    if options.dtype not in ("auto", *DTYPES):
        raise PlanRefused(f"--dtype must be auto, float32 or bfloat16, not {options.dtype!r}")
    if options.backend == "triton" and facts.triton_interpreter and options.dtype == "bfloat16":
        return Decision("float32", "Triton's interpreter has no bfloat16")
    if options.dtype != "auto":
        return Decision(options.dtype, "asked (--dtype)")
    stored = ("auto", *NATIVE_METHODS, FP8_METHOD)
    quantized = gguf if options.quantization in stored else options.quantization != "none"
    if quantized:
        return Decision("float32", "quantized weights: their kernels take float32 activations")
    if facts.native_bf16 and not (options.backend == "triton" and facts.triton_interpreter):
        return Decision("bfloat16", f"dense weights, and {facts.kind} multiplies bfloat16 natively")
    return Decision("float32", f"dense weights, and {facts.kind} has no native bfloat16")


def _linear_layers(
    options: LoadOptions, prefixes: list[str], checkpoint: Checkpoint, facts: DeviceFacts, act: torch.dtype
) -> tuple[dict[str, LayerChoice], dict[str, str], dict[str, str]]:
    """Each linear layer's method and kernel, why each method, and the native methods skipped."""
    setting, types = options.quantization, checkpoint.tensor_types
    skipped: dict[str, str] = {}
    native: list[str] = []  # the native methods a layer may get, in order of preference
    if setting in NATIVE_METHODS:
        if (why := quant_method_class(setting).unavailable_reason(facts, act)) is not None:
            raise PlanRefused(f"--quantization {setting} needs tokenmill's native CPU kernel: {why}")
        if not types:
            raise PlanRefused(
                f"--quantization {setting} serves a GGUF file's blocks; {checkpoint.path} is not a GGUF file"
            )
        native = [setting]
    elif setting == "auto" and types:
        for method in NATIVE_METHODS:
            if (why := quant_method_class(method).unavailable_reason(facts, act)) is None:
                native.append(method)
            else:
                skipped[method] = why
    elif setting != "auto" and (why := quant_method_class(setting).unavailable_reason(facts, act)) is not None:
        raise PlanRefused(f"--quantization {setting} cannot run here: {why}")
    layers: dict[str, LayerChoice] = {}
    reasons: dict[str, list[str]] = {}
    stored: dict[str, list[str]] = {}  # a native method's formats, as the layers it multiplies hold them
    fp8: frozenset[str] = checkpoint.config.extra.get("fp8_weights", frozenset())  # type: ignore[assignment]
    for prefix in prefixes:
        kinds = _stored_types(prefix, checkpoint.config, types)
        if fp8 and setting in ("auto", FP8_METHOD):
            method, reason = _fp8_layer_method(_sources(prefix, checkpoint.config), fp8, checkpoint.config)
        else:
            method, reason = _layer_method(setting, native, kinds, prefix, facts.kind == "cpu")
        cls = quant_method_class(method)
        layers[prefix] = LayerChoice(method, cls.kernel_for(facts, act))
        if method in native:
            names = "/".join(sorted(k.name for k in kinds if k is not None))
            if names not in stored.setdefault(method, []):
                stored[method].append(names)
        # Each distinct reason once: layers of one method can be there for different formats (Q4_K, Q6_K).
        elif reason not in reasons.setdefault(method, []):
            reasons[method].append(reason)
    for method, formats in stored.items():
        reasons[method] = [f"the GGUF file's blocks ({', '.join(formats)}), multiplied as stored"]
    return layers, {method: "; ".join(why) for method, why in reasons.items()}, skipped


def _sources(prefix: str, config: ModelConfig) -> list[str]:
    """The checkpoint tensors a layer is made of."""
    if prefix == "lm_head":
        return ["model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"]
    prefix = mtp_checkpoint_prefix(prefix, config.num_layers)  # a multi-token-prediction layer's, as stored
    parent, _, leaf = prefix.rpartition(".")
    return [f"{parent}.{name}.weight" for name in _PACKED_SOURCES.get(leaf, (leaf,))]


def _stored_types(prefix: str, config: ModelConfig, types: dict[str, QType]) -> set[QType | None]:
    """How the checkpoint stores the tensors a layer is made of (None: not a GGUF tensor)."""
    return {types.get(name) for name in _sources(prefix, config)}


def stored_bytes(prefix: str, config: ModelConfig, types: dict[str, QType], weights: int) -> int | None:
    """Bytes the file's blocks of the layer at ``prefix`` take, ``weights`` weights of them (what the
    native kernels keep), or None where the layer is not stored in one block format."""
    kinds = _stored_types(prefix, config, types)
    if len(kinds) != 1 or (qtype := next(iter(kinds))) is None or qtype not in BLOCK_WEIGHTS:
        return None
    return weights // BLOCK_WEIGHTS[qtype] * BLOCK_BYTES[qtype]


def _fp8_layer_method(sources: list[str], fp8: frozenset[str], config: ModelConfig) -> tuple[str, str]:
    """A layer of a checkpoint with FP8 block-scaled weights, under --quantization auto or fp8-block."""
    stored = {name in fp8 for name in sources}
    if stored == {True}:
        block = config.extra["fp8_block"]
        assert isinstance(block, tuple)
        rows, cols = block
        return FP8_METHOD, (
            f"the checkpoint's FP8 blocks (e4m3, a float32 scale per {rows}x{cols}), multiplied as stored "
            "a dequantized tile at a time"
        )
    if stored == {False}:
        return "none", "float tensors, dense"
    return "none", "FP8 and float tensors packed together, dense (exactly dequantized)"


def _layer_method(setting: str, native: list[str], kinds: set[QType | None], prefix: str, cpu: bool) -> tuple[str, str]:
    """The method of one layer under ``--quantization setting`` (``native``: the GGUF methods that may run;
    ``cpu``: the model is on a CPU, where a layer no native kernel serves is dense float32, never int4)."""
    names = "/".join(sorted(k.name if k is not None else "float" for k in kinds))
    if setting == "auto" or setting in NATIVE_METHODS:
        served: set[QType] = set()
        for method in native:
            method_serves: frozenset[QType] = getattr(quant_method_class(method), "served_types", frozenset())
            mixes = getattr(quant_method_class(method), "mixed_formats", False)
            if kinds <= method_serves and (len(kinds) == 1 or mixes):
                return method, "the GGUF file's blocks, multiplied as stored"
            served |= method_serves
        reason = f"{names} tensors, dense (exactly dequantized)"
        if kinds <= _INT4_TYPES:
            why = "no native kernel serves here" if not native else "stored in mixed formats"
            if not cpu:
                return "int4", f"Q4_0/Q4_1 blocks kept as int4 exactly as stored ({why})"
            # On a CPU torch's int4 kernel is fast only in bfloat16, and its bfloat16 scales and products
            # put the embedded model's prompt logprobs 2e-2 off the reference: over the default's bounds.
            return "none", (
                f"{reason}: {why}, and torch's int4 kernel rounds to bfloat16, outside the default's fidelity "
                "bounds (--quantization int4 takes it, at a sixth of the memory)"
            )
        unread = "/".join(sorted(k.name for k in kinds if k in BLOCK_WEIGHTS and k not in served))
        if native and unread:
            reason += f": no native kernel reads {unread} yet"
        elif native and len(kinds) > 1:
            reason += ": stored in mixed formats"
        return "none", reason
    if prefix == "lm_head" and setting == "int4":
        return "int8", "the output head is int8 under int4: it is the layer whose rounding shows most"
    return setting, "asked (--quantization)"


def _check_tensor_parallel(options: LoadOptions, config: ModelConfig, types: dict[str, QType]) -> None:
    experts = config.extra_int("num_experts")
    if options.expert_parallel and not experts:
        raise PlanRefused(f"--expert-parallel needs a mixture-of-experts model; {config.architecture} has no experts")
    if options.tensor_parallel <= 1:
        return
    # Shards hold whole blocks: the checkpoint's largest (a k-quant's 256 weights), or int4's groups of 32.
    block, block_format = largest_block(types.values())
    dims = ModelDims(
        config.num_heads,
        config.num_kv_heads,
        config.head_dim,
        config.intermediate_size,
        config.vocab_size,
        block=block,
        block_format=block_format,
        num_experts=experts,
        expert_width=config.extra_int("expert_width"),
    )
    try:
        check_degree(
            dims,
            options.tensor_parallel,
            int4_groups=options.quantization == "int4",
            expert_parallel=options.expert_parallel,
        )
    except ValueError as e:
        raise PlanRefused(str(e)) from None


def _ops(
    options: LoadOptions,
    asked: type[Ops],
    facts: DeviceFacts,
    act: torch.dtype,
    head_dim: int,
    skipped: dict[str, str],
) -> Decision:
    why = asked.unavailable_reason(facts, act, head_dim)
    if options.backend == "torch":
        # --backend torch: the native CPU kernels where they serve, else the plain torch reference.
        if why is None:
            return Decision("native", "tokenmill's CPU kernels serve this model here")
        skipped["native-ops"] = why
        return Decision("torch", f"the reference ops: native ones cannot run ({why})")
    if why is not None:
        raise PlanRefused(f"--backend {options.backend} cannot run here: {why}")
    return Decision(asked.name, "asked (--backend)")


def _mtp_prefixes(options: LoadOptions, spec: FamilySpec, config: ModelConfig) -> list[str]:
    """The linear layers of the multi-token-prediction layers ``--speculative-method mtp`` serves as
    its draft model ([] for another method); refused where the checkpoint has none or they cannot run."""
    if options.speculative_method != "mtp":
        return []
    prefixes = spec.tensors.mtp_linear_prefixes
    if prefixes is None or not config.extra_int("mtp_layers"):
        raise PlanRefused(
            f"--speculative-method mtp drafts with a checkpoint's multi-token-prediction layers "
            f"(DeepSeek-V3's num_nextn_predict_layers); this {config.architecture} checkpoint has none"
        )
    return list(prefixes(config))


def _kv_cache_dtype(name: str, act: torch.dtype, ops: type[Ops], facts: DeviceFacts, head_dim: int) -> Decision:
    if name == "auto":
        return Decision(dtype_name(act), "the activations' dtype")
    if name == "float32" and act == torch.float32:
        return Decision("float32", "asked (--kv-cache-dtype)")
    if name == "float16":
        if torch.float16 in ops.kv_cache_dtypes:
            return Decision("float16", f"asked (--kv-cache-dtype); the {ops.name} ops read it")
        native = ops_class("native")
        why = native.unavailable_reason(facts, act, head_dim) or f"the {ops.name} ops run their own attention"
        raise PlanRefused(f"--kv-cache-dtype float16 needs tokenmill's native attention kernel: {why}")
    raise PlanRefused(f"--kv-cache-dtype {name} needs {name} activations; they are {dtype_name(act)}")
