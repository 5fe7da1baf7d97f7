"""A whole decoder stack in one native call (decoder_stack.cpp): the per-layer kernels, called from C++.

At one decoding sequence a Llama layer's Python forward (module calls, views, tensor allocations,
a dozen ctypes calls) costs more than its arithmetic. ``DecoderStack`` runs the same kernels on
the same inputs in the same order from native code, so its results are those of the Python
forward bit for bit (tests/kernels/test_decoder_stack.py holds it to that), and the Python per step is
one call. The model describes itself with ``StackSpec``; worker/engine/native_stack.py builds one where every
part has a native kernel. A family's q/k RMSNorm (``StackSpec.qk_norm``: over the whole projection, or
per head) runs between the projection and rotary; a mixture-of-experts layer (``LayerSpec.moe``) runs
its router's product, moe_mlp.cpp's softmax top-k and its experts' one native call in place of the
dense MLP. A layer's LoRA adapter slots (``LinearSpec.lora``) ride along: the step's
tokens by slot (``LoRARows``) are given to each call, and every slot's delta is added after the
layer's product with lora.cpp's kernel, as the eager layers add it. A projection's bias
(``LinearSpec.bias``) is added after that. A layer's attention may have a sliding window, a soft cap and
a sink logit per head (``LayerSpec.window``, ``softcap``, ``sinks``: gpt-oss's), and a model whose
windowed and global layers keep separate block tables (worker/engine/kv_cache_groups.py) has each layer read
its group's tables and its storage tensor, as ``AttentionMetadata.for_layer`` gives them. Gemma's layers:
the dense MLP's activation is GeGLU (``StackSpec.activation``), attention's output and the MLP's are
RMS-normed before their residual adds (``LayerSpec.attn_out_norm``, ``mlp_out_norm``; ``post_norm`` is then
the pre-feedforward norm), and a layer may rotate with tables of its own (``LayerSpec.cos``, ``sin``:
Gemma 3's local and global layers). Rotary may turn only the first dims of each head (``StackSpec.rotary_dim``:
Phi-4-mini's partial rotary), and each sub-layer's output may be scaled before its residual add
(``StackSpec.residual_multiplier``: Granite's). DeepSeek-V3's layers: multi-head latent attention
(``StackSpec.latent``, ``LayerSpec.latent``: latent_attention.cpp over the latent cache, its projections and
norms as the model's attention runs them), grouped sigmoid routing (``MoESpec.grouped``: moe_mlp.cpp's
``tm_moe_route_grouped``, which the native ops' router calls too) and shared experts (a mixture-of-experts
layer's ``gate_up`` and ``down``, their output added to the routed sum).
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tokenmill_service.worker.kernels.attention_metadata import AttentionMetadata
from tokenmill_service.worker.kernels.cpu import abi, build, moe_mlp, paged_attention
from tokenmill_service.worker.kernels.cpu import lora as lora_kernel

if TYPE_CHECKING:
    from tokenmill_service.worker.kernels.moe_routing import GroupedTopK

# The structs as decoder_stack.cpp sees them: both from abi.py's one description.
_Linear, _Layer, _Stack, _LoraBatch, _KvGroup = (
    abi.structure(name) for name in ("TmLinear", "TmLayer", "TmStack", "TmLoraBatch", "TmKvGroup")
)


def _lib() -> ctypes.CDLL:
    return build.load("decoder_stack")  # its functions typed from abi.py


def unavailable_reason() -> str | None:
    # (and "lora" where adapters ride along, "moe_mlp" where experts do, "latent_attention" for DeepSeek's)
    for name in ("decoder_stack", "elementwise", "paged_attention"):
        if (reason := build.unavailable_reason(name)) is not None:
            return reason
    return None


@dataclass(frozen=True, slots=True)
class LinearSpec:
    """A linear layer: ``kernel`` (library, symbol) multiplies by ``weights`` in ``fmt``, then ``bias`` is added."""

    kernel: tuple[str, str]
    weights: torch.Tensor
    fmt: int
    out_features: int
    # LoRA adapter slots (None: none), as worker/layers/lora/slots.py holds them: A [slots, parts, rank, in], B
    # transposed [slots, rank, out_features] (both float32 or bfloat16), int64 ranks [slots, parts] (the rows
    # each slot fills) and int64 [parts, 2]: each part's output columns (start, count).
    lora: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    bias: torch.Tensor | None = None  # float32 [out_features] (None: none)


@dataclass(frozen=True, slots=True)
class LoRARows:
    """A step's tokens by LoRA adapter slot: group g is slot ``slots[g]``, rows ``rows[offsets[g]:offsets[g + 1]]``."""

    slots: torch.Tensor  # int64 [groups]
    offsets: torch.Tensor  # int64 [groups + 1]
    rows: torch.Tensor  # int64


@dataclass(frozen=True, slots=True)
class MoESpec:
    """A mixture-of-experts MLP: the router's product ([experts, hidden]), its choice (moe_mlp.cpp's
    ``tm_moe_route``: softmax top-k renormalized where ``renormalize``, or the top-k logits softmaxed where
    ``top_logits``), and the experts (``NativeExperts``)."""

    router: LinearSpec
    experts: moe_mlp.NativeExperts
    renormalize: bool
    top_logits: bool = False
    # DeepSeek-V3's group-limited sigmoid routing (moe_mlp.cpp's ``tm_moe_route_grouped``; None: softmax):
    # the router's ``GroupedTopK`` and its score-correction bias (float32 [experts]).
    grouped: GroupedTopK | None = None
    score_bias: torch.Tensor | None = None

    @property
    def routing(self) -> str:
        """The choice as abi.ROUTING_MODES names it."""
        if self.grouped is not None:
            return "grouped_renormalized" if self.renormalize else "grouped"
        return "top_logits" if self.top_logits else "renormalized" if self.renormalize else "softmax"


@dataclass(frozen=True, slots=True)
class LatentSpec:
    """A layer's multi-head latent attention (DeepSeek's), as worker/models/deepseek_v3.py's attention runs it: the
    layer's ``qkv`` is its query projection (q_proj, or q_b_proj after ``q_a`` and ``q_a_norm``),
    ``kv_a`` kv_a_proj_with_mqa ([latent + rope, hidden]) whose latent ``kv_a_norm`` norms, ``w_kv_b``
    kv_b_proj's weight float32 [heads, nope + v, latent] (the absorbed products' w_uk and w_uv)."""

    kv_a: LinearSpec
    kv_a_norm: torch.Tensor
    w_kv_b: torch.Tensor
    q_a: LinearSpec | None = None
    q_a_norm: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class LatentDims:
    """The stack's latent attention sizes (``StackSpec.latent``): the latent (kv_lora_rank), each head's
    plain query dims and value dims (its rotary dims are the stack's head_dim), the latent norms' epsilon,
    and whether the rotary dims come as interleaved pairs (de-interleaved before rotating)."""

    latent: int
    nope: int
    v_head_dim: int
    eps: float
    interleave: bool


@dataclass(frozen=True, slots=True)
class LayerSpec:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: LinearSpec  # q, k and v rows, in that order
    o: LinearSpec
    gate_up: LinearSpec | None  # gate rows, then up rows (None: the layer's MLP is ``moe``)
    down: LinearSpec | None
    moe: MoESpec | None = None
    q_norm: torch.Tensor | None = None  # the q/k RMSNorm weights where ``StackSpec.qk_norm`` is not "none"
    k_norm: torch.Tensor | None = None
    # Attention: keys within ``window`` of the query (None: all), scores soft-capped (None: not), a sink
    # logit per head (float32 [heads]; None: none), as ``paged_attention.paged_attention`` takes them.
    window: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None
    # Gemma's sandwich norms (None: none): o's output and the MLP's each RMS-normed before its residual add.
    attn_out_norm: torch.Tensor | None = None
    mlp_out_norm: torch.Tensor | None = None
    # The layer's rotary tables where they are not the stack's ([positions, rotary_dim / 2]; None: the stack's).
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
    # Multi-head latent attention (``StackSpec.latent`` set): its projections, norms and kv_b_proj's weight.
    # A mixture-of-experts layer with ``gate_up`` and ``down`` has shared experts: that MLP added to the routed sum.
    latent: LatentSpec | None = None


@dataclass(frozen=True, slots=True)
class StackSpec:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    scale: float
    cos: torch.Tensor  # [positions, rotary_dim / 2]
    sin: torch.Tensor
    final_norm: torch.Tensor
    layers: list[LayerSpec]
    kv_dtype: torch.dtype = torch.float32  # the KV cache's: float32 or float16
    # q/k RMSNorm (abi.QK_NORM_MODES): "none", "whole" (each token's q and k projections, OLMoE's) or
    # "heads" (each head, Qwen3's): q_norm / k_norm [heads * head_dim] / [kv_heads * head_dim] or [head_dim].
    qk_norm: str = "none"
    # The dense MLP's activation (abi.ACTIVATIONS): "silu" (SiLU-and-mul) or "gelu_tanh" (Gemma's GeGLU).
    activation: str = "silu"
    # The dims rotary turns, the first of each head (None: all of them; fewer: partial rotary, Phi-4-mini's).
    rotary_dim: int | None = None
    # Attention's and the MLP's outputs times this before their residual adds (Granite's; 1: none).
    residual_multiplier: float = 1.0
    # Every layer's attention latent (DeepSeek's; heads, head_dim = rotary_dim: its heads and rotary dims), or None.
    latent: LatentDims | None = None


class DecoderStack:
    """``stack(x, positions, meta)``: the final norm's output [T, hidden] for embeddings x [T, hidden]."""

    def __init__(self, spec: StackSpec) -> None:
        rotary_dim = _check_stack(spec)
        tensors, norms, lora_width = _operands(spec)
        for t in tensors + norms:
            if t.device.type != "cpu" or not t.is_contiguous():
                raise ValueError("the native decoder stack reads contiguous CPU tensors")
        for t in [spec.cos, spec.sin, *norms]:
            if t.dtype != torch.float32:
                raise ValueError("the native decoder stack's norms, biases, sinks and rotary tables are float32")
        self.spec = spec  # keeps every tensor the native side points into alive
        self._layers = (_Layer * len(spec.layers))(*(_layer_struct(ly) for ly in spec.layers))
        self._stack = _stack_struct(spec, ctypes.addressof(self._layers), rotary_dim, lora_width)
        self._workspace = torch.empty(0)
        self._lock = threading.Lock()  # one call at a time: they share the workspace
        # Each layer's (KV-cache group, storage tensor) as the last step's metadata placed them, flat.
        self._placement: tuple[int, ...] = ()
        self._layer_kv = torch.empty(0, dtype=torch.int64)

    def __call__(
        self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, lora: LoRARows | None = None
    ) -> torch.Tensor:
        t, hidden = x.shape
        assert x.dtype == torch.float32 and x.device.type == "cpu" and hidden == self.spec.hidden
        k_cache, v_cache = meta.k_cache, meta.v_cache
        assert k_cache.dtype == v_cache.dtype == self.spec.kv_dtype, (k_cache.dtype, self.spec.kv_dtype)
        assert k_cache.is_contiguous() and v_cache.is_contiguous()
        x = x.contiguous()
        positions, seq_of_token = positions.contiguous(), meta.seq_of_token.contiguous()
        out = torch.empty(t, hidden, device=x.device)
        batch = None
        if lora is not None and lora.slots.numel():
            if not self._stack.lora_width:
                raise ValueError("this decoder stack has no LoRA adapter slots")
            lora = LoRARows(*(v.to(torch.int64).contiguous() for v in (lora.slots, lora.offsets, lora.rows)))
            batch = _LoraBatch(lora.slots.numel(), lora.slots.data_ptr(), lora.offsets.data_ptr(), lora.rows.data_ptr())
        with self._lock:
            metas, layer_kv = self._kv_groups(meta)
            kept = [(m.slot_mapping.contiguous(), m.block_tables.contiguous()) for m in metas]
            groups = (_KvGroup * len(kept))(*(_KvGroup(s.data_ptr(), b.data_ptr(), b.shape[1]) for s, b in kept))
            threads = torch.get_num_threads()
            need = int(_lib().tm_stack_workspace(ctypes.byref(self._stack), t, threads))
            if self._workspace.numel() < need:
                self._workspace = torch.empty(need, device=x.device)
            rc = _lib().tm_decoder_stack(
                ctypes.byref(self._stack), x.data_ptr(), t, positions.data_ptr(), seq_of_token.data_ptr(),
                ctypes.addressof(groups),
                layer_kv, k_cache.data_ptr(), v_cache.data_ptr(), k_cache[0].numel() * k_cache.element_size(),
                v_cache[0].numel() * v_cache.element_size(), meta.block_size,
                ctypes.byref(batch) if batch is not None else None, self._workspace.data_ptr(), out.data_ptr(),
                threads,
            )  # fmt: skip
        if rc:
            kind, layer = next((k, base - rc) for k, base in _FAILURES if rc > base - 100)
            raise RuntimeError(f"the native decoder stack failed in {kind} of layer {layer} (code {rc})")
        return out

    def _kv_groups(self, meta: AttentionMetadata) -> tuple[list[AttentionMetadata], int | None]:
        """The step's KV-cache groups (each its metadata) and the address of each layer's (group, storage
        tensor) pairs (None: one group, layer l in tensor l)."""
        if meta.layer_kv is None:
            return [meta], None
        if len(meta.layer_kv) != len(self.spec.layers):
            raise ValueError(f"the metadata places {len(meta.layer_kv)} layers, the stack has {len(self.spec.layers)}")
        metas: list[AttentionMetadata] = []
        index: dict[int, int] = {}
        placement: list[int] = []
        for m, tensor in meta.layer_kv:
            if (g := index.get(id(m))) is None:
                g = index[id(m)] = len(metas)
                metas.append(m)
                if m.k_cache.data_ptr() != meta.k_cache.data_ptr() or m.v_cache.data_ptr() != meta.v_cache.data_ptr():
                    raise ValueError("every KV-cache group's metadata must point at the step's caches")
            placement += (g, tensor)
        if tuple(placement) != self._placement:  # the runner's placement: the same every step
            self._placement = tuple(placement)
            self._layer_kv = torch.tensor(placement, dtype=torch.int64)
        return metas, self._layer_kv.data_ptr()


# The stack's failure codes: base - layer for a failure in each kind of kernel.
_FAILURES = (("a product", -100), ("attention", -200), ("the experts", -300))


# -- building the native structs from a StackSpec: checked, then pointed into -------------------------


def _check_stack(spec: StackSpec) -> int:
    """The stack-wide settings checked (ValueError naming what is wrong); its rotary dims."""
    if not spec.layers:
        raise ValueError("a decoder stack needs at least one layer")
    if spec.qk_norm not in abi.QK_NORM_MODES:
        raise ValueError(f"q/k norms are one of {', '.join(abi.QK_NORM_MODES)}, not {spec.qk_norm!r}")
    if spec.activation not in abi.ACTIVATIONS:
        raise ValueError(f"the MLP's activation is one of {', '.join(abi.ACTIVATIONS)}, not {spec.activation!r}")
    rotary_dim = spec.head_dim if spec.rotary_dim is None else spec.rotary_dim
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > spec.head_dim:
        raise ValueError(f"rotary turns an even number of a head's {spec.head_dim} dims, not {rotary_dim}")
    if spec.cos.dim() != 2 or spec.cos.shape[1] != rotary_dim // 2 or spec.sin.shape != spec.cos.shape:
        raise ValueError(f"the rotary tables are [positions, {rotary_dim // 2}] (rotary dims / 2)")
    return rotary_dim


def _operands(spec: StackSpec) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    """Every layer checked; the tensors the native side reads, those of them it reads as float32 (norms,
    biases, sinks, rotary tables, latent weights), and the widest LoRA slot (parts * rank; 0: none)."""
    tensors = [spec.cos, spec.sin, spec.final_norm]
    norms = [spec.final_norm]
    widths = [0]
    for layer in spec.layers:
        tensors += [layer.input_norm, layer.post_norm]
        norms += [layer.input_norm, layer.post_norm]
        _check_mlp(layer, spec.hidden)
        _check_latent(layer, spec)
        _check_qk_norm(layer, spec)
        _check_attention(layer, spec)
        if layer.sinks is not None:
            norms.append(layer.sinks)  # read as float32, like the norms
        norms += [n for n in (layer.attn_out_norm, layer.mlp_out_norm) if n is not None]
        _check_rotary_and_norms(layer, spec)
        norms += [r for r in (layer.cos, layer.sin) if r is not None]  # read as float32, like the stack's
        if spec.qk_norm != "none":
            assert layer.q_norm is not None and layer.k_norm is not None
            norms += [layer.q_norm, layer.k_norm]
        linears: list[LinearSpec | None] = [layer.qkv, layer.o, layer.gate_up, layer.down]
        if layer.moe is not None:
            linears.append(layer.moe.router)
            norms += [layer.moe.score_bias] if layer.moe.score_bias is not None else []  # read as float32
        if (lat := layer.latent) is not None:
            linears += [lat.kv_a, lat.q_a]
            norms += [lat.kv_a_norm, lat.w_kv_b, *([lat.q_a_norm] if lat.q_a_norm is not None else [])]
        for lin in linears:
            if lin is None:
                continue
            tensors.append(lin.weights)
            if lin.bias is not None:
                if lin.bias.shape != (lin.out_features,):
                    raise ValueError(f"a bias is one value per output feature ({lin.out_features})")
                norms.append(lin.bias)  # read as float32, like the norms
            if lin.lora is not None:
                tensors += _check_lora(lin)
                widths.append(lin.lora[0].shape[1] * lin.lora[0].shape[2])
    return tensors, norms, max(widths)


def _check_lora(lin: LinearSpec) -> list[torch.Tensor]:
    assert lin.lora is not None
    a, bt, ranks, parts = lin.lora
    if (
        a.dtype not in lora_kernel.DTYPES
        or bt.dtype != a.dtype
        or ranks.dtype != torch.int64
        or parts.dtype != torch.int64
        or a.dim() != 4
        or a.shape[1] != parts.shape[0]
        or a.shape[2] != bt.shape[1]
        or ranks.shape != a.shape[:2]
        or bt.shape[2] != lin.out_features
    ):
        raise ValueError(
            "a layer's LoRA slots are A [slots, parts, rank, in] and B.T [slots, rank, out] "
            "(float32 or bfloat16), int64 ranks [slots, parts] and int64 part columns [parts, 2]"
        )
    return [a, bt, ranks, parts]


def _pointer(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _linear_struct(lin: LinearSpec | None) -> ctypes.Structure:  # a _Linear
    if lin is None:
        return _Linear()
    out = _Linear(build.address(*lin.kernel), lin.weights.data_ptr(), lin.fmt, lin.out_features)
    out.bias = _pointer(lin.bias)
    if lin.lora is not None:
        a, bt, ranks, parts = lin.lora
        out.lora_a, out.lora_bt, out.lora_ranks, out.lora_part_rows = (
            a.data_ptr(),
            bt.data_ptr(),
            ranks.data_ptr(),
            parts.data_ptr(),
        )
        out.lora_rank, out.lora_parts, out.lora_dtype = a.shape[2], a.shape[1], lora_kernel.DTYPES[a.dtype]
    return out


def _layer_struct(ly: LayerSpec) -> ctypes.Structure:  # a _Layer
    linear, pointer = _linear_struct, _pointer
    out = _Layer(ly.input_norm.data_ptr(), ly.post_norm.data_ptr(),
                 linear(ly.qkv), linear(ly.o), linear(ly.gate_up), linear(ly.down),
                 pointer(ly.q_norm), pointer(ly.k_norm),
                 linear(ly.moe.router if ly.moe is not None else None),
                 ly.moe.experts.address() if ly.moe is not None else None,
                 abi.ROUTING_MODES[ly.moe.routing] if ly.moe is not None else 0,
                 ly.window or 0, ly.softcap or 0.0, pointer(ly.sinks),
                 pointer(ly.attn_out_norm), pointer(ly.mlp_out_norm), pointer(ly.cos), pointer(ly.sin))  # fmt: skip
    if (lat := ly.latent) is not None:
        out.q_a, out.q_a_norm, out.kv_a = linear(lat.q_a), pointer(lat.q_a_norm), linear(lat.kv_a)
        out.kv_a_norm, out.w_kv_b = lat.kv_a_norm.data_ptr(), lat.w_kv_b.data_ptr()
    if ly.moe is not None and ly.moe.grouped is not None:
        out.score_bias = pointer(ly.moe.score_bias)
        out.n_group, out.topk_group = ly.moe.grouped.n_group, ly.moe.grouped.topk_group
        out.route_scale = ly.moe.grouped.scaling
    return out


def _stack_struct(spec: StackSpec, layers: int, rotary_dim: int, lora_width: int) -> ctypes.Structure:  # a _Stack
    """The stack's settings and the kernels' entry points it calls (``layers``: the address of its _Layer array)."""
    moes = [ly.moe for ly in spec.layers if ly.moe is not None]
    moe = [
        build.address("moe_mlp", name) if moes else None for name in ("tm_moe_route", "tm_moe_workspace", "tm_moe_mlp")
    ]
    stack = _Stack(
        len(spec.layers), spec.hidden, spec.heads, spec.kv_heads, spec.head_dim, spec.intermediate,
        spec.eps, spec.scale, spec.cos.data_ptr(), spec.sin.data_ptr(), spec.final_norm.data_ptr(), layers,
        build.address("elementwise", "tm_rms_norm"), build.address("elementwise", "tm_rotary"),
        build.address("elementwise", abi.ACTIVATIONS[spec.activation]),
        *(build.address("paged_attention", paged_attention.symbol(name, spec.kv_dtype))
          for name in ("tm_store_keys", "tm_store_values", "tm_paged_attention_window")),
        build.address("lora", "tm_lora_add") if lora_width else None, lora_width,
        abi.QK_NORM_MODES[spec.qk_norm],
        *moe, max((m.experts.top_k for m in moes), default=0),
        rotary_dim, spec.residual_multiplier,
    )  # fmt: skip
    if (dims := spec.latent) is not None:
        stack.latent, stack.nope, stack.v_head_dim, stack.latent_eps = dims.latent, dims.nope, dims.v_head_dim, dims.eps
        stack.rope_interleave = int(dims.interleave)
        stack.latent_attention = build.address("latent_attention", paged_attention.symbol(
            "tm_latent_attention", spec.kv_dtype))  # fmt: skip
    if any(m.grouped is not None for m in moes):
        stack.moe_route_grouped = build.address("moe_mlp", "tm_moe_route_grouped")
    return stack


def _check_mlp(layer: LayerSpec, hidden: int) -> None:
    if (layer.gate_up is None) != (layer.down is None) or layer.moe is None and layer.gate_up is None:
        raise ValueError(
            "a layer's MLP is dense (gate_up and down), a mixture of experts (moe), or both (shared experts)"
        )
    if layer.moe is not None:
        moe, experts = layer.moe, layer.moe.experts
        if experts.hidden != hidden or moe.router.out_features != experts.num_experts:
            raise ValueError("a mixture-of-experts layer's router and experts must match the stack's hidden size")
        if (moe.grouped is None) != (moe.score_bias is None) or (
            moe.score_bias is not None and moe.score_bias.shape != (experts.num_experts,)
        ):
            raise ValueError("grouped routing takes a score-correction bias, one value per expert")
        if moe.grouped is not None:
            moe.grouped.check(experts.num_experts, experts.top_k)


def _check_latent(layer: LayerSpec, spec: StackSpec) -> None:
    dims, lat = spec.latent, layer.latent
    if (dims is None) != (lat is None):
        raise ValueError("a stack's layers all have latent attention (StackSpec.latent), or none of them")
    if dims is None or lat is None:
        return
    heads, rope = spec.heads, spec.head_dim
    if any(d % 16 for d in (dims.latent, rope, dims.v_head_dim)) or dims.nope <= 0:
        raise ValueError(f"latent attention takes latent, rotary and value dims in 16s, not {dims}")
    if (lat.q_a is None) != (lat.q_a_norm is None) or (
        lat.q_a is not None and lat.q_a_norm is not None and lat.q_a_norm.shape != (lat.q_a.out_features,)
    ):
        raise ValueError("the low-rank query path is q_a_proj and its norm, both or neither")
    if layer.qkv.out_features != heads * (dims.nope + rope) or layer.o.out_features != spec.hidden:
        raise ValueError(f"a latent layer's query projection gives {heads} heads of {dims.nope} + {rope} dims")
    if lat.kv_a.out_features != dims.latent + rope or lat.kv_a_norm.shape != (dims.latent,):
        raise ValueError(f"kv_a_proj_with_mqa gives a latent of {dims.latent} and a rotary key of {rope}")
    if lat.w_kv_b.shape != (heads, dims.nope + dims.v_head_dim, dims.latent):
        raise ValueError(f"kv_b_proj's weight is [{heads}, {dims.nope + dims.v_head_dim}, {dims.latent}]")
    if spec.rotary_dim not in (None, rope) or any(x is not None for x in (layer.cos, layer.q_norm, layer.sinks)):
        raise ValueError("a latent layer rotates its whole rotary dims with the stack's tables, no q/k norms, no sinks")
    if layer.window is not None or layer.softcap is not None:
        raise ValueError("latent attention has no window nor soft cap")


def _check_attention(layer: LayerSpec, spec: StackSpec) -> None:
    if layer.window is not None and layer.window < 1 or layer.softcap is not None and layer.softcap <= 0:
        raise ValueError(f"a window is at least 1 key and a soft cap above 0, not {layer.window} and {layer.softcap}")
    if layer.sinks is not None and layer.sinks.shape != (spec.heads,):
        raise ValueError(f"attention sinks are one logit per head ({spec.heads}), not {tuple(layer.sinks.shape)}")


def _check_rotary_and_norms(layer: LayerSpec, spec: StackSpec) -> None:
    if (layer.cos is None) != (layer.sin is None):
        raise ValueError("a layer's own rotary tables are a cos and a sin table, both or neither")
    for table in (layer.cos, layer.sin):
        if table is not None and table.shape != spec.cos.shape:
            raise ValueError(f"a layer's rotary tables are [positions, rotary_dim / 2], not {table.shape}")
    for norm in (layer.attn_out_norm, layer.mlp_out_norm):
        if norm is not None and norm.shape != (spec.hidden,):
            raise ValueError(f"the norms of attention's and the MLP's outputs take {spec.hidden} weights")


def _check_qk_norm(layer: LayerSpec, spec: StackSpec) -> None:
    if spec.qk_norm == "none":
        if layer.q_norm is not None or layer.k_norm is not None:
            raise ValueError("q/k norm weights given to a stack without q/k norms")
        return
    whole = spec.qk_norm == "whole"
    sizes = (spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim) if whole else (spec.head_dim,) * 2
    if layer.q_norm is None or layer.k_norm is None or (layer.q_norm.numel(), layer.k_norm.numel()) != sizes:
        raise ValueError(f"q/k norms over {'the whole projection' if whole else 'each head'} take weights of {sizes}")
