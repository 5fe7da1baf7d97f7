"""The decoder every family's module is built on, as a plain ``nn.Module``: attention (q/k/v packed in one
projection, rotary, paged attention within the layer's window), a gated MLP, pre-norm layers with a float32
residual stream, the final norm and the head. Llama's, Mistral's and Qwen2's module is this one unchanged
(llama.py holds their specs); a family that differs overrides a seam (``before_rotary``, ``make_mlp``,
``make_rotary``, ``embed``, ``branch``) or its attention's ``params`` in a subclass of its own.

Built from ``layers/`` (linear layers with their quantization method, vocabulary-parallel
embedding and head, norms, rotary tables) and ``kernels/`` (the hot arithmetic, by the backend the plan picked),
for one tensor-parallel rank. Checkpoint tensors keep Hugging Face's names; ``load_weights``
routes each into its layer's loader (worker/models/weights.py), packing q/k/v and gate/up as they arrive.

The model runs a flat batch of tokens from many sequences; ``AttentionMetadata`` says how they
split and where the KV cache is. The residual stream is float32; the linear layers see the
model's dtype (``act_dtype``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, cast

import torch
from torch import nn

from tokenmill_service.worker.distributed.parallel import TensorParallel
from tokenmill_service.worker.kernels.attention_metadata import AttentionMetadata
from tokenmill_service.worker.kernels.attention_params import AttentionParams
from tokenmill_service.worker.kernels.interface import Ops
from tokenmill_service.worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tokenmill_service.worker.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    QuantFactory,
    RowParallelLinear,
)
from tokenmill_service.worker.layers.norm import RMSNorm
from tokenmill_service.worker.layers.quant.gguf_blocks import CheckpointTensor
from tokenmill_service.worker.layers.rotary import RotaryEmbedding
from tokenmill_service.worker.models.config import ModelConfig, layer_window
from tokenmill_service.worker.models.params import LayerParams
from tokenmill_service.worker.models.registry import family
from tokenmill_service.worker.models.spec import Facts
from tokenmill_service.worker.models.weights import PACKED_QKV_GATE_UP, load_weights, weight_bytes

if TYPE_CHECKING:
    from tokenmill_service.contract.plan.plan import LoadPlan


class DecoderAttention(nn.Module):
    """q/k/v packed in one projection, rotary, paged attention (within the layer's window), the output
    projection. What a family does to q and k before rotary is its ``before_rotary`` (its spec's
    ``facts.qk_norm`` says which norm, for the native stack)."""

    def __init__(self, p: LayerParams) -> None:
        super().__init__()
        config, quant, prefix, tp = p.config, p.quant, p.prefix, p.tp
        self.layer_idx = p.layer_idx
        self.ops = p.ops
        self.head_dim = config.head_dim
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
        self.rotary = p.rotary
        # What the attention op takes of the layer: its scale and its sliding window (None: the whole context;
        # worker/models/config.py says which layers have one); a family adds its soft cap (Gemma 2's) or sinks
        # (gpt-oss's).
        self.params = AttentionParams(self.head_dim**-0.5, layer_window(config, p.layer_idx))

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
        out: torch.Tensor = self.ops.attention(q, k_cache, v_cache, meta, self.params)
        return out.flatten(1)


class GatedMLP(nn.Module):
    """gate/up packed in one projection, SiLU-and-mul, down."""

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


class DecoderLayer(nn.Module):
    """A layer's modules; ``DecoderModel.forward`` runs it as ``pre_attention``, attention, ``post_attention``."""

    # Each sub-layer's output times this before its residual add (``branch``; Granite's); 1: none.
    residual_multiplier: float = 1.0

    def __init__(self, p: LayerParams, attention_type: type[DecoderAttention] = DecoderAttention) -> None:
        super().__init__()
        config = p.config
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, p.ops, p.act_dtype)
        self.self_attn = attention_type(p.under("self_attn"))
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, p.ops, p.act_dtype)
        self.mlp = self.make_mlp(p.under("mlp"))

    def make_mlp(self, p: LayerParams) -> nn.Module:
        """A family's seam on the layer's feed-forward block (mixture-of-experts families put their experts here)."""
        return GatedMLP(p.config, p.prefix, p.ops, p.quant, p.tp)

    def branch(self, x: torch.Tensor) -> torch.Tensor:
        """Each sub-layer's output before its residual add, times ``residual_multiplier`` (Granite's; Llama's is
        1: x as it is). The native decoder stack applies the same multiplier; a family that needs more here
        overrides this and declares no native stack (worker/engine/native_stack.py refuses an overridden one)."""
        return x if self.residual_multiplier == 1.0 else x * self.residual_multiplier


# A decoder layer runs as two regions around attention: each is a plain function of the layer and
# flat [T, ...] tensors (no metadata, no Python lists), which is what the compiled executor hands
# to a compiler; attention, whose work depends on the batch's shape, stays eager between them.


def pre_attention(
    layer: DecoderLayer, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Residual add, input norm, q/k/v projection, rotary: (q, k, v, residual)."""
    h, residual = layer.input_layernorm(x, residual)
    q, k, v = layer.self_attn.project(positions, h)
    return q, k, v, residual


def post_attention(
    layer: DecoderLayer, attn: torch.Tensor, residual: torch.Tensor
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


class DecoderModel(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        ops: Ops,
        quant: QuantFactory,
        act_dtype: torch.dtype,
        embed_dtype: torch.dtype,
        head_dtype: torch.dtype,
        tp: TensorParallel,
        attention_type: type[DecoderAttention] = DecoderAttention,
        layer_type: type[DecoderLayer] = DecoderLayer,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, embed_dtype, tp)
        rotary = self.make_rotary(config, ops)
        self.layers = nn.ModuleList(
            layer_type(LayerParams(config, f"model.layers.{i}", i, rotary, ops, quant, tp, act_dtype), attention_type)
            for i in range(config.num_layers)
        )
        self.norm = self.make_norm(config, ops, head_dtype)
        self.act_dtype = act_dtype

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, run: Regions = EAGER
    ) -> torch.Tensor:
        x = self.embed(input_ids)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            q, k, v, residual = run.pre_attention(layer, positions, x, residual)
            x, residual = run.post_attention(layer, layer.self_attn.attend(q, k, v, meta), residual)
        assert residual is not None
        return run.final_norm(self.norm, x, residual)

    def make_norm(self, config: ModelConfig, ops: Ops, out_dtype: torch.dtype) -> RMSNorm:
        """A family's seam on the final norm (Gemma's norms times 1 + w)."""
        return RMSNorm(config.hidden_size, config.rms_norm_eps, ops, out_dtype)

    def make_rotary(self, config: ModelConfig, ops: Ops) -> RotaryEmbedding:
        """A family's seam on the rotary tables every layer shares (Phi-3 rotates part of each head)."""
        return RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling, ops
        )

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """A family's seam on the token embeddings (Granite scales them); Llama's are the table's rows."""
        rows: torch.Tensor = self.embed_tokens(input_ids)
        return rows


class DecoderForCausalLM(nn.Module):
    """The decoder and its head (the compute; what the family declares is its spec, below)."""

    # The attention module of every layer: a family that changes q and k subclasses it (``before_rotary``).
    attention_type: ClassVar[type[DecoderAttention]] = DecoderAttention
    # The decoder stack and its layers, for a family that changes the embeddings or the residual branches.
    model_type: ClassVar[type[DecoderModel]] = DecoderModel
    layer_type: ClassVar[type[DecoderLayer]] = DecoderLayer
    # The functions a forward pass runs between attention calls, which an executor may compile.
    regions_type: ClassVar[type[Regions]] = Regions
    # Checkpoint projections that live packed in one layer here: name -> (layer, shard id).
    packed_modules: ClassVar[Mapping[str, tuple[str, str | int]]] = PACKED_QKV_GATE_UP

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
        # What the family's spec states of its layers (the native stack builds itself from these).
        self.facts: Facts = family(config.architecture).facts
        self.ops = ops
        self.act_dtype = act_dtype
        self.kv_dtype = act_dtype  # what the KV cache stores (the plan may choose float16)
        self.tp = tp
        self.quantization = "none"  # what the plan chose, for reports ("int4+int8" when mixed)
        self.plan: LoadPlan | None = None  # the plan it was built from (worker/models/builder.py)
        # The multi-token-prediction layers, where the family has and serves them (DeepSeek-V3's).
        self.mtp = nn.ModuleList()
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
        self.eager = self.regions_type()  # its regions as they are, uncompiled

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device

    @property
    def max_positions(self) -> int:
        return self.config.max_position_embeddings

    def attention_windows(self) -> list[int | None]:
        """Each layer's sliding window in tokens (None: it attends to the whole context)."""
        return [cast(DecoderLayer, layer).self_attn.params.window for layer in self.model.layers]

    def kv_cache_shapes(self, num_blocks: int, block_size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The (key, value) cache shapes for this rank, in its ops backend's layout."""
        layer = self.model.layers[0]
        assert isinstance(layer, DecoderLayer)
        attn = layer.self_attn
        return self.ops.kv_cache_layout.shapes(
            len(self.model.layers), num_blocks, block_size, attn.num_kv_heads, attn.head_dim
        )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, run: Regions | None = None
    ) -> torch.Tensor:
        """input_ids, positions: [T] flat over the batch. Returns the final hidden states [T, hidden].
        ``run``: the regions between attention calls, compiled (worker/engine/executor.py), or None: as they are."""
        hidden: torch.Tensor = self.model(input_ids, positions, meta, run or self.eager)
        return hidden

    def compute_logits(self, hidden: torch.Tensor, run: Regions | None = None) -> torch.Tensor:
        """Float32 logits [N, vocab] for the selected hidden rows."""
        return (run or self.eager).head_logits(self.lm_head, hidden)

    def load_weights(self, tensors: Iterable[tuple[str, CheckpointTensor]]) -> None:
        """Every checkpoint tensor (Hugging Face names) into its layer (worker/models/weights.py)."""
        load_weights(self, tensors, self.packed_modules, self.config.tie_word_embeddings)

    def weight_bytes(self) -> int:
        """Bytes of weights one forward pass reads (linear layers as stored, embedding rows aside)."""
        return weight_bytes(self)
