"""A Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2; Qwen3 and Granite in their own files)
as a plain ``nn.Module``.

Built from ``layers/`` (linear layers with their quantization method, vocabulary-parallel
embedding and head, norms, rotary tables) and ``kernels/`` (the hot arithmetic, by the backend the plan picked),
for one tensor-parallel rank. Checkpoint tensors keep Hugging Face's names; ``load_weights``
routes each into its layer's loader, packing q/k/v and gate/up as they arrive.

The model runs a flat batch of tokens from many sequences; ``AttentionMetadata`` says how they
split and where the KV cache is. The residual stream is float32; the linear layers see the
model's dtype (``act_dtype``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from gguf import GGMLQuantizationType as QType
from torch import nn

from tokenmill_service.distributed.parallel import TensorParallel
from tokenmill_service.kernels.attention_metadata import AttentionMetadata
from tokenmill_service.kernels.interface import Ops
from tokenmill_service.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tokenmill_service.layers.linear import (
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    QuantFactory,
    RowParallelLinear,
)
from tokenmill_service.layers.norm import RMSNorm
from tokenmill_service.layers.quant.gguf_blocks import CheckpointTensor
from tokenmill_service.layers.rotary import RotaryEmbedding
from tokenmill_service.models.config import FULL, SLIDING, ModelConfig, layer_window
from tokenmill_service.models.registry import register_model

if TYPE_CHECKING:
    from tokenmill_service.plan.plan import LoadPlan

# llama.cpp's names (convert_hf_to_gguf.py) of the tensors outside the layers, and of a layer's parts.
GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


# Architectures whose ``sliding_window`` applies to every layer -> transformers' default where
# config.json has no such key (MistralConfig's is 4096; null: no window).
EVERY_LAYER_WINDOWS: dict[str, int | None] = {
    "MistralForCausalLM": 4096,
    "MixtralForCausalLM": None,
    "Phi3ForCausalLM": None,
}
# Architectures whose window applies only with ``use_sliding_window``, from ``max_window_layers`` on.
FLAGGED_WINDOWS = frozenset({"Qwen2ForCausalLM", "Qwen3ForCausalLM"})
# ... and only with ``use_sliding_window``, to every layer (transformers' Qwen3-MoE).
FLAGGED_EVERY_LAYER_WINDOWS = frozenset({"Qwen3MoeForCausalLM"})


def read_sliding_window(raw: dict[str, Any], hf_architecture: str, config: ModelConfig) -> None:
    """The sliding window as transformers applies it (its configuration and modeling files): Mistral,
    Mixtral and Phi-3 to every layer when ``sliding_window`` is set (null: none); Qwen2 and Qwen3 only
    with ``use_sliding_window``, to the layers ``layer_types`` marks, or from ``max_window_layers`` on;
    Qwen3-MoE only with ``use_sliding_window``, to every layer. Any other architecture has none."""
    if hf_architecture in FLAGGED_EVERY_LAYER_WINDOWS:
        window = raw.get("sliding_window", 4096) if raw.get("use_sliding_window", False) else None
    elif hf_architecture in FLAGGED_WINDOWS:
        window = raw.get("sliding_window", 4096)
        if not raw.get("use_sliding_window", False) or not window:
            return
        first = int(raw.get("max_window_layers", 28))
        types = raw.get("layer_types") or [SLIDING if i >= first else FULL for i in range(config.num_layers)]
        config.extra["layer_types"] = list(types)
    elif hf_architecture in EVERY_LAYER_WINDOWS:
        window = raw.get("sliding_window", EVERY_LAYER_WINDOWS[hf_architecture])
    else:
        return
    if window:
        config.extra["sliding_window"] = int(window)


class LlamaAttention(nn.Module):
    # What ``before_rotary`` does, for the native decoder stack (abi.QK_NORM_MODES): "none", an RMSNorm of
    # each token's whole q and k projections ("whole"), or of each head ("heads").
    qk_norm: ClassVar[str] = "none"

    def __init__(
        self,
        config: ModelConfig,
        prefix: str,
        layer_idx: int,
        rotary: RotaryEmbedding,
        ops: Ops,
        quant: QuantFactory,
        tp: TensorParallel,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.ops = ops
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            config.head_dim,
            config.num_heads,
            config.num_kv_heads,
            config.attention_bias,
            quant(f"{prefix}.qkv_proj"),
            tp,
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(
            config.num_heads * config.head_dim, config.hidden_size, False, quant(f"{prefix}.o_proj"), tp
        )
        self.rotary = rotary
        # The layer's sliding window (None: the whole context; models/config.py says which layers have one).
        self.window = layer_window(config, layer_idx)

    def project(self, positions: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k (rotated) and v of the new tokens: [T, heads, head_dim] each."""
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.qkv_proj.q_size, self.qkv_proj.kv_size, self.qkv_proj.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        q, k = self.before_rotary(q, k)
        q, k = self.rotary(positions, q, k)
        return q, k, v.view(t, self.num_kv_heads, self.head_dim)

    def before_rotary(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A family's seam between the projection and rotary (Qwen3 norms each head here); Llama has none."""
        return q, k

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Store the new keys and values in the cache, attend over it: [T, heads * head_dim]."""
        meta, k_cache, v_cache = meta.for_layer(self.layer_idx)
        self.ops.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if self.window is None:  # the call every ops implementation takes (a window is an optional argument)
            return self.ops.attention(q, k_cache, v_cache, meta, self.scale).flatten(1)
        return self.ops.attention(q, k_cache, v_cache, meta, self.scale, window=self.window).flatten(1)


class LlamaMLP(nn.Module):
    # Its activation as the native decoder stack names it (kernels/cpu/abi.py's ACTIVATIONS).
    activation: ClassVar[str] = "silu"

    def __init__(self, config: ModelConfig, prefix: str, ops: Ops, quant: QuantFactory, tp: TensorParallel) -> None:
        super().__init__()
        self.ops = ops
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [size, size], False, quant(f"{prefix}.gate_up_proj"), tp
        )
        self.down_proj = RowParallelLinear(size, config.hidden_size, False, quant(f"{prefix}.down_proj"), tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))
        return y


class LlamaDecoderLayer(nn.Module):
    """A layer's modules; ``LlamaModel.forward`` runs it as ``pre_attention``, attention, ``post_attention``."""

    # The feed-forward block: a family with another activation subclasses LlamaMLP (Gemma's GeGLU).
    mlp_type: ClassVar[type[LlamaMLP]] = LlamaMLP
    # Gemma's: attention's and the MLP's outputs each normed before their residual add (the native stack's
    # attn_out_norm / mlp_out_norm), the MLP's input by pre_feedforward_layernorm.
    sandwich_norms: ClassVar[bool] = False
    # Each sub-layer's output times this before its residual add (``branch``; Granite's); 1: none.
    residual_multiplier: float = 1.0

    def __init__(
        self,
        config: ModelConfig,
        prefix: str,
        layer_idx: int,
        rotary: RotaryEmbedding,
        ops: Ops,
        quant: QuantFactory,
        act_dtype: torch.dtype,
        tp: TensorParallel,
        attention_type: type[LlamaAttention] = LlamaAttention,
    ) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, ops, act_dtype)
        self.self_attn = attention_type(config, f"{prefix}.self_attn", layer_idx, rotary, ops, quant, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, ops, act_dtype)
        self.mlp = self.make_mlp(config, f"{prefix}.mlp", layer_idx, ops, quant, tp)

    def make_mlp(
        self, config: ModelConfig, prefix: str, layer_idx: int, ops: Ops, quant: QuantFactory, tp: TensorParallel
    ) -> nn.Module:
        """A family's seam on the layer's MLP: one of ``mlp_type`` (mixture-of-experts families put their
        experts here)."""
        return self.mlp_type(config, prefix, ops, quant, tp)

    def branch(self, x: torch.Tensor) -> torch.Tensor:
        """Each sub-layer's output before its residual add, times ``residual_multiplier`` (Granite's; Llama's is
        1: x as it is). The native decoder stack applies the same multiplier; a family that needs more here
        overrides this and declares no native stack (engine/native_stack.py refuses an overridden one)."""
        return x if self.residual_multiplier == 1.0 else x * self.residual_multiplier


# A decoder layer runs as two regions around attention: each is a plain function of the layer and
# flat [T, ...] tensors (no metadata, no Python lists), which is what the compiled executor hands
# to a compiler; attention, whose work depends on the batch's shape, stays eager between them.


def pre_attention(
    layer: LlamaDecoderLayer, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Residual add, input norm, q/k/v projection, rotary: (q, k, v, residual)."""
    h, residual = layer.input_layernorm(x, residual)
    q, k, v = layer.self_attn.project(positions, h)
    return q, k, v, residual


def post_attention(
    layer: LlamaDecoderLayer, attn: torch.Tensor, residual: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Output projection, residual add, post-attention norm, MLP: (x, residual)."""
    h, residual = layer.post_attention_layernorm(layer.branch(layer.self_attn.o_proj(attn)), residual)
    return layer.branch(layer.mlp(h)), residual


def final_norm(norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    y: torch.Tensor = norm(x, residual)[0]
    return y


def head_logits(head: ParallelLMHead, hidden: torch.Tensor) -> torch.Tensor:
    logits: torch.Tensor = head(hidden)
    return logits


@dataclass(slots=True)
class Regions:
    """The functions a forward pass runs between its eager parts, compiled or as they are."""

    pre_attention: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = pre_attention
    post_attention: Callable[..., tuple[torch.Tensor, torch.Tensor]] = post_attention
    final_norm: Callable[..., torch.Tensor] = final_norm
    head_logits: Callable[..., torch.Tensor] = head_logits


EAGER = Regions()


class LlamaModel(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        ops: Ops,
        quant: QuantFactory,
        act_dtype: torch.dtype,
        embed_dtype: torch.dtype,
        head_dtype: torch.dtype,
        tp: TensorParallel,
        attention_type: type[LlamaAttention] = LlamaAttention,
        layer_type: type[LlamaDecoderLayer] = LlamaDecoderLayer,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, embed_dtype, tp)
        rotary = self.make_rotary(config, ops)
        self.layers = nn.ModuleList(
            layer_type(config, f"model.layers.{i}", i, rotary, ops, quant, act_dtype, tp, attention_type)
            for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops, head_dtype)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, run: Regions = EAGER
    ) -> torch.Tensor:
        x = self.embed(input_ids)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            assert isinstance(layer, LlamaDecoderLayer)
            q, k, v, residual = run.pre_attention(layer, positions, x, residual)
            x, residual = run.post_attention(layer, layer.self_attn.attend(q, k, v, meta), residual)
        assert residual is not None
        return run.final_norm(self.norm, x, residual)

    def make_rotary(self, config: ModelConfig, ops: Ops) -> RotaryEmbedding:
        """A family's seam on the rotary tables every layer shares (Phi-3 rotates part of each head)."""
        return RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling, ops
        )

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """A family's seam on the token embeddings (Granite scales them); Llama's are the table's rows."""
        rows: torch.Tensor = self.embed_tokens(input_ids)
        return rows


@register_model("llama", "mistral", "qwen2")
class LlamaForCausalLM(nn.Module):
    # The runner may run its decoder layers and final norm as one native call (engine/native_stack.py).
    native_stack: ClassVar[bool] = True
    # Where a family has no native stack, what the stack lacks (the plan's executor reason names it).
    native_stack_gap: ClassVar[str] = ""
    # The attention module of every layer: a family that changes q and k subclasses it (``before_rotary``).
    attention_type: ClassVar[type[LlamaAttention]] = LlamaAttention
    # The decoder stack and its layers, for a family that changes the embeddings or the residual branches.
    model_type: ClassVar[type[LlamaModel]] = LlamaModel
    layer_type: ClassVar[type[LlamaDecoderLayer]] = LlamaDecoderLayer
    # The functions a forward pass runs between attention calls, which an executor may compile.
    regions_type: ClassVar[type[Regions]] = Regions
    # Checkpoint projections that live packed in one layer here: name -> (layer, shard id).
    packed_modules: ClassVar[dict[str, tuple[str, str | int]]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    # -- what the loaders ask of a family (models/registry.py) -------------------------------
    # Hugging Face ``architectures`` and GGUF ``general.architecture`` names -> the registered name they
    # run as. Each family declares its own (a subclass does not inherit these). Tools write "mistral"
    # for Mistral's llama-shaped GGUFs (llama.cpp itself converts them as "llama").
    hf_architectures: ClassVar[dict[str, str]] = {
        "LlamaForCausalLM": "llama",
        "MistralForCausalLM": "mistral",
        "Qwen2ForCausalLM": "qwen2",
    }
    gguf_architectures: ClassVar[dict[str, str]] = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}
    # GGUF architectures whose q/k rows llama.cpp's converter permuted for ggml's pairwise RoPE.
    gguf_permuted: ClassVar[frozenset[str]] = frozenset({"llama", "mistral"})
    # llama.cpp's tensor names -> the model's: outside the layers, and a layer's part (``blk.N.<part>``).
    gguf_global_names: ClassVar[dict[str, str]] = GGUF_GLOBAL_NAMES
    gguf_layer_names: ClassVar[dict[str, str]] = GGUF_LAYER_NAMES
    # GGUF tensors that hold a setting, not weights -> the ``config.extra`` key their values go to
    # (a list of floats), before ``read_gguf_config`` runs (Phi-3's LongRoPE factors).
    gguf_config_tensors: ClassVar[dict[str, str]] = {}
    # A family that reads its GGUF head sizes and RoPE scaling itself (``read_gguf_config``; DeepSeek's MLA).
    gguf_reads_attention: ClassVar[bool] = False
    # ``rope_scaling`` types this family reads itself (``read_hf_config``); the loader reads only llama3's.
    hf_rope_types: ClassVar[frozenset[str]] = frozenset()
    # GGUF ``rope.scaling.type`` values this family reads itself (``read_gguf_config``); the loader none.
    gguf_rope_types: ClassVar[frozenset[str]] = frozenset()
    # The config.json key naming the MLP's activation, and the one activation this family runs.
    hf_activation: ClassVar[tuple[str, str]] = ("hidden_act", "silu")

    @classmethod
    def read_hf_config(cls, raw: dict[str, Any], hf_architecture: str, config: ModelConfig) -> None:
        """Set what this family reads from ``config.json`` beyond the common keys (ValueError: refused)."""
        if hf_architecture == "Qwen2ForCausalLM":
            config.attention_bias = True  # always there, never declared
        read_sliding_window(raw, hf_architecture, config)

    @classmethod
    def read_gguf_config(cls, field: Callable[[str], Any], gguf_architecture: str, config: ModelConfig) -> None:
        """Set what this family reads from GGUF metadata (``field(key)``, None if absent) beyond the common keys."""
        if cls is LlamaForCausalLM and gguf_architecture == "llama" and field("llama.expert_count"):
            # llama.cpp writes Mixtral as a "llama" GGUF with experts: it runs as the mixtral family.
            from tokenmill_service.models.registry import model_class

            config.architecture = "mixtral"
            model_class("mixtral").read_gguf_config(field, gguf_architecture, config)

    @classmethod
    def hf_stored_types(cls, config: ModelConfig) -> dict[str, QType]:
        """The safetensors tensors this family reads as GGUF-style blocks, by name (none: all float)."""
        return {}

    @classmethod
    def unfuse(cls, name: str, config: ModelConfig) -> list[tuple[str, int, int]] | None:
        """The layers a fused checkpoint tensor packs, as (name, first row, rows); None: not fused."""
        return None

    def __init__(
        self,
        config: ModelConfig,
        ops: Ops,
        quant: QuantFactory,
        act_dtype: torch.dtype = torch.float32,
        embed_dtype: torch.dtype | None = None,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        tp = tp or TensorParallel()
        self.config = config
        self.ops = ops
        self.act_dtype = act_dtype
        self.kv_dtype = act_dtype  # what the KV cache stores (the plan may choose float16)
        self.tp = tp
        self.quantization = "none"  # what the plan chose, for reports ("int4+int8" when mixed)
        self.plan: LoadPlan | None = None  # the plan it was built from (models/builder.py)
        head_quant = quant("lm_head")
        self.model = self.model_type(
            config,
            ops,
            quant,
            act_dtype,
            embed_dtype or act_dtype,
            head_quant.act_dtype,
            tp,
            self.attention_type,
            self.layer_type,
        )
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size, head_quant, tp)

    @classmethod
    def linear_prefixes(cls, config: ModelConfig) -> list[str]:
        """Every linear layer, as ``quant`` is asked for them (packed q/k/v and gate/up)."""
        leaves = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
        return [f"model.layers.{i}.{leaf}" for i in range(config.num_layers) for leaf in leaves] + ["lm_head"]

    @classmethod
    def kv_cache_values_per_token(cls, config: ModelConfig, tensor_parallel: int = 1) -> tuple[int, int]:
        """Values one token of context caches on a rank (a key and a value per layer for each of its
        key/value heads), and those of a per-head cache, for comparison with families that cache
        less (the same here)."""
        kv_heads = max(1, config.num_kv_heads // tensor_parallel)
        values = config.num_layers * 2 * kv_heads * config.head_dim
        return values, values

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device

    @property
    def max_positions(self) -> int:
        return self.config.max_position_embeddings

    def attention_windows(self) -> list[int | None]:
        """Each layer's sliding window in tokens (None: it attends to the whole context)."""
        return [getattr(layer.self_attn, "window", None) for layer in self.model.layers]

    def kv_cache_shapes(self, num_blocks: int, block_size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The (key, value) cache shapes for this rank, in its ops backend's layout."""
        layer = self.model.layers[0]
        assert isinstance(layer, LlamaDecoderLayer)
        attn = layer.self_attn
        return self.ops.kv_cache_layout.shapes(
            len(self.model.layers), num_blocks, block_size, attn.num_kv_heads, attn.head_dim
        )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, run: Regions = EAGER
    ) -> torch.Tensor:
        """input_ids, positions: [T] flat over the batch. Returns the final hidden states [T, hidden].
        ``run``: the regions between attention calls, as they are or compiled (engine/executor.py)."""
        hidden: torch.Tensor = self.model(input_ids, positions, meta, run)
        return hidden

    def compute_logits(self, hidden: torch.Tensor, run: Regions = EAGER) -> torch.Tensor:
        """Float32 logits [N, vocab] for the selected hidden rows."""
        return run.head_logits(self.lm_head, hidden)

    # -- loading ---------------------------------------------------------------------------

    def load_weights(self, tensors: Iterable[tuple[str, CheckpointTensor]]) -> None:
        """Route every checkpoint tensor (Hugging Face names) into its layer; then check that
        every layer got all of its pieces and convert them to the kernels' layouts."""
        loaded: dict[str, set[_Piece]] = {}
        for name, tensor in tensors:
            targets = [name]
            if self.config.tie_word_embeddings and name == "model.embed_tokens.weight":
                targets.append("lm_head.weight")
            for target in targets:
                path, _, kind = target.rpartition(".")
                parent, _, leaf = path.rpartition(".")
                shard: str | int | None = None
                if leaf in self.packed_modules:
                    leaf, shard = self.packed_modules[leaf]
                    path = f"{parent}.{leaf}"
                try:
                    module = self.get_submodule(path)
                except AttributeError:
                    raise ValueError(f"checkpoint tensor {name!r} has no counterpart in the model") from None
                if kind == "bias" and isinstance(module, LinearBase):
                    module.load_bias(tensor, shard)  # type: ignore[arg-type]
                elif kind == "weight" and (load_weight := getattr(module, "load_weight", None)) is not None:
                    load_weight(tensor, shard)
                else:
                    raise ValueError(f"checkpoint tensor {name!r} has no counterpart in the model")
                loaded.setdefault(path, set()).add((kind, shard))
        self._check_complete(loaded)
        for module in self.modules():
            if isinstance(module, LinearBase):
                module.finalize()

    def _check_complete(self, loaded: dict[str, set[_Piece]]) -> None:
        missing = []
        for path, module in self.named_modules():
            if isinstance(module, LinearBase):
                want: set[_Piece] = {("weight", s) for s in _shard_ids(module)}
                if module.bias is not None:
                    want |= {("bias", s) for s in _shard_ids(module)}
            elif isinstance(module, (RMSNorm, VocabParallelEmbedding)):
                want = {("weight", None)}
            else:
                continue
            for kind, shard in sorted(want - loaded.get(path, set()), key=str):
                missing.append(f"{path}.{kind}" + ("" if shard is None else f" ({shard})"))
        if missing:
            raise ValueError(f"the checkpoint lacks {len(missing)} tensor(s): {', '.join(missing[:8])}")

    def weight_bytes(self) -> int:
        """Bytes of weights one forward pass reads (linear layers as stored, embedding rows aside)."""
        total = sum(m.quant.weight_bytes(m) for m in self.modules() if isinstance(m, LinearBase))
        norms = sum(m.weight.numel() * 4 for m in self.modules() if isinstance(m, RMSNorm))
        return total + norms


# A piece of a layer's checkpoint tensors: ("weight" or "bias", its shard id).
_Piece = tuple[str, str | int | None]


def _shard_ids(module: LinearBase) -> list[str | int | None]:
    if isinstance(module, QKVParallelLinear):
        return ["q", "k", "v"]
    if isinstance(module, MergedColumnParallelLinear):
        return list(range(len(module.local_sizes)))
    return [None]
