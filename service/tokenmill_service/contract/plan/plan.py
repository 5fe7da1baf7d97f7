"""The load plan: everything decided about how a model runs, each decision with its reason.

Made once per worker by ``resolve_plan`` (worker/plan/resolve.py) from what the user asked
(``LoadOptions``), the checkpoint, and the device's facts; then the model is built from it, the
runner picks its executor from it, ``model_loaded`` logs it and ``GetModelInfo`` reports it.
Nothing else decides any of these. Torch-free (dtypes by name), so it travels to the server.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from tokenmill_service.contract.model_paths import ModelLoadError
from tokenmill_service.contract.plan.options import LoadOptions

# How a forward pass runs: the model's own loop from Python; the decoder stack in one native call;
# the regions between attention calls through torch.compile.
EXECUTORS = ("eager", "native-stack", "compiled")


class PlanRefused(ModelLoadError):
    """What was asked cannot run here; the message says why and what would."""


@dataclass(frozen=True, slots=True)
class Decision:
    value: str
    reason: str


@dataclass(frozen=True, slots=True)
class LayerChoice:
    """How one linear layer stores and multiplies its weight: a registered method and its kernel."""

    method: str
    kernel: str


@dataclass(frozen=True, slots=True)
class LoadPlan:
    options: LoadOptions
    device: str  # "cpu" or "cuda:N"
    architecture: str  # the model family's registered name ("llama")
    act_dtype: Decision  # the linear layers' activations (the residual stream is float32 whatever)
    embed_dtype: str  # the embedding table's storage
    ops: Decision  # the registered ops backend ("native", "torch", "triton")
    kv_cache_dtype: Decision
    kv_cache_layout: str  # the ops backend's layout, by name
    executor: Decision  # one of EXECUTORS
    # Every linear layer by prefix ("model.layers.0.self_attn.qkv_proj", "lm_head").
    layers: Mapping[str, LayerChoice]
    # Why each method in ``layers`` serves the layers it does.
    quant_reasons: Mapping[str, str]
    tensor_parallel: int = 1
    # Bytes of KV cache one token of context takes on a rank, and how that figure is made up.
    kv_cache_bytes_per_token: Decision = Decision("0", "")
    # Faster choices this device could not take, and why (what ``native_kernel_skipped`` logged).
    skipped: Mapping[str, str] = field(default_factory=dict)
    # A mixture-of-experts model's experts: "native" (one call a layer) or "one-by-one"; None: no experts.
    experts: Decision | None = None
    # What LoRA adapter slots store (--max-loras): bfloat16, or float32 under --dtype float32.
    lora_dtype: Decision = Decision("float32", "no adapter slots")
    # A family's rotary scaling chosen by the served context (LongRoPE's short or long factors); None: the
    # family's rotary does not depend on it.
    rope: Decision | None = None
    # On a CPU: the instruction set of the native kernels (every one gives the same bits); None elsewhere.
    cpu_isa: Decision | None = None
    # The integer-product kernels' activations: "16-bit" or "int8" (--activations); None where no layer takes them.
    activations: Decision | None = None

    def quant_method(self, prefix: str) -> LayerChoice:
        """The method of the linear layer at ``prefix`` (vLLM's ``get_quant_method(layer, prefix)``)."""
        try:
            return self.layers[prefix]
        except KeyError:
            raise KeyError(f"the load plan has no linear layer {prefix!r}") from None

    @property
    def method_counts(self) -> dict[str, int]:
        """Layers per method ("gguf-vnni": 120, "none": 1)."""
        return dict(sorted(Counter(c.method for c in self.layers.values()).items()))

    @property
    def quantization(self) -> str:
        """The methods, for reports: "gguf-vnni", or "int4+int8" where layers differ."""
        return "+".join(self.method_counts)

    def summary(self) -> dict[str, str]:
        """Each decision as ``value (reason)``, for the ``model_loaded`` log line and GetModelInfo."""
        kernels = Counter(f"{c.method}/{c.kernel}" for c in self.layers.values())
        out = {
            "architecture": self.architecture,
            "device": self.device,
            **({"cpu_isa": _shown(self.cpu_isa)} if self.cpu_isa is not None else {}),
            "dtype": _shown(self.act_dtype),
            **({"activations": _shown(self.activations)} if self.activations is not None else {}),
            "embedding_dtype": self.embed_dtype,
            "ops": _shown(self.ops),
            "kv_cache_dtype": _shown(self.kv_cache_dtype),
            "kv_cache_layout": self.kv_cache_layout,
            "kv_cache_bytes_per_token": _shown(self.kv_cache_bytes_per_token),
            "executor": _shown(self.executor),
            **({"experts": _shown(self.experts)} if self.experts is not None else {}),
            **({"rope": _shown(self.rope)} if self.rope is not None else {}),
            "tensor_parallel": str(self.tensor_parallel),
            "expert_parallel": str(self.options.expert_parallel).lower(),
            "linear_layers": ", ".join(f"{k}: {n}" for k, n in sorted(kernels.items())),
        }
        if self.options.speculative_method == "mtp":
            out["speculative_method"] = "mtp (drafts from the checkpoint's multi-token-prediction layer)"
        if self.options.max_loras > 0:
            out["lora"] = (
                f"{self.options.max_loras} adapter slots, rank up to {self.options.max_lora_rank}, "
                f"{_shown(self.lora_dtype)}"
            )
        out |= {f"quantization.{m}": reason for m, reason in sorted(self.quant_reasons.items())}
        out |= {f"skipped.{what}": reason for what, reason in sorted(self.skipped.items())}
        return out


def _shown(decision: Decision) -> str:
    return f"{decision.value} ({decision.reason})"
