"""tokenmill's native C ABI, written once: the GGUF block formats every kernel reads, every exported
function's signature, and the decoder stack's structs.

Both sides are made from it. ``header()`` is the C header every kernel source includes (``tm_abi.h``,
generated at build by build.py): the block table as constants and as the kernels' names and block sizes
(``TmFormat``), the structs with ``static_assert``s of the sizes and offsets ctypes computes for them, and an
``extern "C"`` prototype of each exported function. C linkage allows no overloads, so a definition whose
parameters differ from its prototype does not compile, and a struct laid out differently from the ctypes one
fails its ``static_assert``: a mismatch stops the build instead of passing garbage at run time. The ctypes
side (argument and return types, the Structures) is derived here too (``bind``, ``structure``).
"""

from __future__ import annotations

import ctypes
import functools
import re
from dataclasses import dataclass

# Weights per block in the formats the native kernels read (``TM_QK``); k-quants' super-blocks hold 256.
QUANT_BLOCK = 32
SUPER_BLOCK = 256  # ggml's QK_K


@dataclass(frozen=True, slots=True)
class BlockFormat:
    name: str
    id: int  # ggml's type id (F32 is tokenmill's plain float32 rows, in ggml's F32 slot)
    block_weights: int  # weights per block: QUANT_BLOCK, or SUPER_BLOCK for a k-quant
    block_bytes: int  # bytes per block
    # Which native kernels read it: "blocks" (block_gemm.cpp and vnni_gemm.cpp, in blocks of QUANT_BLOCK),
    # "kquant" (kquant_gemm.cpp, in super-blocks); None: only dequantized, in torch.
    kernel: str | None = None


# Every GGUF block format tokenmill reads, exactly as ggml lays them out (sizes as gguf's GGML_QUANT_SIZES).
BLOCK_FORMATS = (
    BlockFormat("F32", 0, QUANT_BLOCK, 4 * QUANT_BLOCK, kernel="blocks"),
    BlockFormat("Q4_0", 2, QUANT_BLOCK, 18, kernel="blocks"),  # float16 scale, 16 bytes of 4-bit weights
    BlockFormat("Q4_1", 3, QUANT_BLOCK, 20, kernel="blocks"),  # float16 scale and minimum, 16 bytes of 4-bit weights
    BlockFormat("Q5_0", 6, QUANT_BLOCK, 22, kernel="blocks"),  # float16 scale, 32 high bits, 16 bytes of low nibbles
    BlockFormat(
        "Q5_1", 7, QUANT_BLOCK, 24, kernel="blocks"
    ),  # float16 scale and minimum, 32 high bits, 16 bytes of low nibbles
    BlockFormat("Q8_0", 8, QUANT_BLOCK, 34, kernel="blocks"),  # float16 scale, 32 int8 weights
    BlockFormat(
        "Q2_K", 10, SUPER_BLOCK, 84, kernel="kquant"
    ),  # 16 sub-blocks of 16: 4-bit scale and minimum each, 2-bit weights
    BlockFormat(
        "Q3_K", 11, SUPER_BLOCK, 110, kernel="kquant"
    ),  # 16 sub-blocks of 16: 6-bit scales, 3-bit weights (2 low bits and a high-bit mask)
    BlockFormat(
        "Q4_K", 12, SUPER_BLOCK, 144, kernel="kquant"
    ),  # 8 sub-blocks of 32: 6-bit scale and minimum each, 4-bit weights
    BlockFormat("Q5_K", 13, SUPER_BLOCK, 176, kernel="kquant"),  # as Q4_K, with a fifth bit per weight
    BlockFormat("Q6_K", 14, SUPER_BLOCK, 210, kernel="kquant"),  # 16 sub-blocks of 16: int8 scales, 6-bit weights
    BlockFormat(
        "IQ4_NL", 20, QUANT_BLOCK, 18, kernel="blocks"
    ),  # float16 scale, 4-bit indices into a fixed non-linear table
    BlockFormat("IQ4_XS", 23, SUPER_BLOCK, 136, kernel="kquant"),  # 8 sub-blocks of 32: 6-bit scales, IQ4_NL's table
    BlockFormat("MXFP4", 39, QUANT_BLOCK, 17, kernel="blocks"),  # e8m0 scale, 16 bytes of 4-bit e2m1 values
)
# ggml type id -> bytes per block, for the formats each native kernel reads.
NATIVE_FORMATS = {f.id: f.block_bytes for f in BLOCK_FORMATS if f.kernel == "blocks"}
KQUANT_FORMATS = {f.id: f.block_bytes for f in BLOCK_FORMATS if f.kernel == "kquant"}
# kquant_gemm's format id for a layer whose row ranges are stored in different k-quants (a packed
# q/k/v whose v is Q6_K and q, k Q4_K, as Q4_K_M files have it): the packed weights then start with a
# header of KQUANT_HEADER_BYTES: int64 count, then per segment int64 format, rows and byte offset.
KQUANT_MIXED = 255
KQUANT_MAX_SEGMENTS = 4
KQUANT_HEADER_BYTES = 128
# The decoder stack's q/k RMSNorm (TmStack.qk_norm): none, over each token's whole q (and k) projection
# (OLMoE), or over each head (Qwen3, Qwen3-MoE).
QK_NORM_MODES = {"none": 0, "whole": 1, "heads": 2}
# A mixture-of-experts router's choice (moe_mlp.cpp's tm_moe_route, TmLayer.routing): softmax over every
# expert's logit then the top_k probabilities ("softmax"; Mixtral, OLMoE...), those divided by their sum
# ("renormalized"), or the top_k logits then a softmax over the chosen ("top_logits": gpt-oss). DeepSeek-V3's
# group-limited sigmoid routing (tm_moe_route_grouped; the decoder stack's layers only): "grouped", its
# weights renormalized where "grouped_renormalized".
ROUTING_MODES = {"softmax": 0, "renormalized": 1, "top_logits": 2, "grouped": 3, "grouped_renormalized": 4}
# The decoder stack's dense MLP activation (TmStack.activation): the elementwise.cpp kernel of each, of one
# signature: SiLU-and-mul (Llama...), or GeGLU, gelu with the tanh approximation (Gemma).
ACTIVATIONS = {"silu": "tm_silu_and_mul", "gelu_tanh": "tm_gelu_tanh_and_mul"}
# What LoRA adapter slots store (lora.cpp): float32, or bfloat16 (products accumulate in float32 either way).
LORA_DTYPES = {"float32": 0, "bfloat16": 1}

# Every exported function, by library (the .cpp it is defined in), exactly as defined there.
FUNCTIONS: dict[str, tuple[str, ...]] = {
    "block_gemm": (
        (
            "int tm_block_gemm(int fmt, const float* x, int64_t m, int64_t k, const uint8_t* w, int64_t n, float* y, "
            "int threads)"
        ),
        "int tm_block_dequantize(int fmt, const uint8_t* w, int64_t n, int64_t k, float* out)",
    ),
    "vnni_gemm": (
        "int64_t tm_vnni_packed_bytes(int fmt, int64_t n, int64_t k)",
        "int tm_vnni_pack(int fmt, const uint8_t* src, int64_t n, int64_t k, uint8_t* out)",
        (
            "int tm_vnni_gemm(int fmt, const float* x, int64_t m, int64_t k, const uint8_t* w, int64_t n, float* y, "
            "int threads)"
        ),
        "int tm_vnni_dequantize(int fmt, const uint8_t* w, int64_t n, int64_t k, float* out)",
        "int tm_vnni_quantize(const float* x, int64_t m, int64_t k, int16_t* q, float* dq)",
        (
            "int tm_vnni_gemm_int8(int fmt, const float* x, int64_t m, int64_t k, const uint8_t* w, int64_t n, "
            "float* y, int threads)"
        ),
        "int tm_vnni_quantize_int8(const float* x, int64_t m, int64_t k, int8_t* q, float* d)",
    ),
    "kquant_gemm": (
        "int64_t tm_kquant_packed_bytes(int fmt, int64_t n, int64_t k)",
        "int tm_kquant_pack(int fmt, const uint8_t* src, int64_t n, int64_t k, uint8_t* out)",
        (
            "int tm_kquant_gemm(int fmt, const float* x, int64_t m, int64_t k, const uint8_t* w, int64_t n, "
            "float* y, int threads)"
        ),
        "int tm_kquant_dequantize(int fmt, const uint8_t* w, int64_t n, int64_t k, float* out)",
        (
            "int tm_kquant_gemm_int8(int fmt, const float* x, int64_t m, int64_t k, const uint8_t* w, int64_t n, "
            "float* y, int threads)"
        ),
    ),
    "sampling": (
        "void tm_log_softmax(const float* x, int64_t rows, int64_t n, int64_t x_stride, float* out, int threads)",
        "void tm_softmax(const float* x, int64_t n, float* out)",
        "void tm_argmax_rows(const float* x, int64_t rows, int64_t n, int64_t x_stride, int64_t* out)",
    ),
    "elementwise": (
        (
            "void tm_rms_norm(const float* x, int64_t x_stride, const float* residual, const float* weight, float eps, "
            "float* h_out, float* normed, int64_t t, int64_t d)"
        ),
        (
            "void tm_rotary(float* x, int64_t x_stride, int64_t t, int64_t heads, int64_t head_dim, int64_t rotary_dim, "
            "const int64_t* positions, const float* cos_table, const float* sin_table)"
        ),
        "void tm_silu_and_mul(const float* x, float* out, int64_t t, int64_t n)",
        "void tm_gelu_tanh_and_mul(const float* x, float* out, int64_t t, int64_t n)",
        "void tm_clamped_swiglu_and_mul(const float* x, float* out, int64_t t, int64_t n, float alpha, float limit)",
    ),
    "paged_attention": tuple(
        signature
        for suffix, cache in (("", "float"), ("_f16", "uint16_t"))
        for signature in (
            (
                f"void tm_store_keys{suffix}(const float* k, int64_t k_stride, int64_t t, int64_t kv_heads, "
                f"int64_t head_dim, const int64_t* slots, {cache}* k_cache, int64_t block_size)"
            ),
            (
                f"void tm_store_values{suffix}(const float* v, int64_t v_stride, int64_t t, int64_t row, "
                f"const int64_t* slots, {cache}* v_cache)"
            ),
            (
                f"int tm_paged_attention{suffix}(const float* q, int64_t t, int64_t heads, int64_t kv_heads, "
                f"int64_t head_dim, const {cache}* k_cache, const {cache}* v_cache, int64_t block_size, "
                "const int64_t* positions, const int64_t* seq_of_token, const int64_t* tables, int64_t table_width, "
                "float scale, float* out, int threads)"
            ),
            (
                f"int tm_paged_attention_window{suffix}(const float* q, int64_t t, int64_t heads, "
                f"int64_t kv_heads, int64_t head_dim, const {cache}* k_cache, const {cache}* v_cache, "
                "int64_t block_size, const int64_t* positions, const int64_t* seq_of_token, const int64_t* tables, "
                "int64_t table_width, float scale, int64_t window, float softcap, const float* sinks, float* out, "
                "int threads)"
            ),
        )
    ),
    "lora": (
        (
            "int tm_lora_add(int dtype, const float* x, int64_t in, const TmLoraBatch* batch, const uint8_t* a, "
            "const uint8_t* bt, const int64_t* ranks, int64_t max_rank, int64_t parts, const int64_t* part_rows, "
            "int64_t out, float* y, float* scratch, int threads)"
        ),
    ),
    "latent_attention": tuple(
        (
            f"int tm_latent_attention{suffix}(const float* q_nope, int64_t nope_t, int64_t nope_h, "
            "const float* q_rope, int64_t rope_t, int64_t rope_h, int64_t t, int64_t heads, int64_t nope, "
            "int64_t latent, int64_t rope, int64_t v, const float* w_uk, int64_t uk_h, int64_t uk_n, "
            "const float* w_uv, int64_t uv_h, int64_t uv_l, int64_t uv_v, "
            f"const {cache}* latent_cache, const {cache}* rope_cache, int64_t block_size, "
            "const int64_t* positions, const int64_t* seq_of_token, const int64_t* tables, int64_t table_width, "
            "float scale, float* out, int threads)"
        )
        for suffix, cache in (("", "float"), ("_f16", "uint16_t"))
    ),
    "memory_probe": ("int64_t tm_stream_read(const uint8_t* p, int64_t bytes, int threads)",),
    "moe_mlp": (
        (
            "void tm_moe_route(const float* logits, int64_t t, int64_t experts, int64_t top_k, int64_t routing, "
            "float* weights, int64_t* ids)"
        ),
        (
            "void tm_moe_route_grouped(const float* logits, int64_t t, int64_t experts, int64_t top_k, "
            "const float* score_bias, int64_t n_group, int64_t topk_group, int64_t renormalize, float scaling, "
            "float* weights, int64_t* ids)"
        ),
        "int64_t tm_moe_workspace(const TmExperts* e, int64_t t, int threads)",
        (
            "int tm_moe_mlp(const TmExperts* e, const float* x, int64_t t, const int64_t* ids, const float* weights, "
            "float* workspace, float* out, int threads)"
        ),
    ),
    "decoder_stack": (
        "int64_t tm_stack_workspace(const TmStack* s, int64_t t, int threads)",
        (
            "int tm_decoder_stack(const TmStack* s, const float* x, int64_t t, const int64_t* positions, "
            "const int64_t* seq_of_token, const TmKvGroup* groups, const int64_t* layer_kv, uint8_t* k_cache, "
            "uint8_t* v_cache, int64_t layer_bytes, int64_t v_layer_bytes, int64_t block_size, const TmLoraBatch* lora, "
            "float* workspace, float* out, int threads)"
        ),
        "void tm_stack_profile(int64_t* out)",
    ),
}

# The kernels the decoder stack calls through pointers (the caches untyped: float32 or float16).
FUNCTION_POINTERS = {
    "TmGemm": "int (*)(int fmt, const float* x, int64_t m, int64_t k, const uint8_t* w, int64_t n, float* y, "
    "int threads)",
    "TmRmsNorm": "void (*)(const float* x, int64_t x_stride, const float* residual, const float* weight, float eps, "
    "float* h_out, float* normed, int64_t t, int64_t d)",
    "TmRotary": "void (*)(float* x, int64_t x_stride, int64_t t, int64_t heads, int64_t head_dim, "
    "int64_t rotary_dim, const int64_t* positions, const float* cos_table, const float* sin_table)",
    "TmSiluAndMul": "void (*)(const float* x, float* out, int64_t t, int64_t n)",
    "TmClampedSwiglu": "void (*)(const float* x, float* out, int64_t t, int64_t n, float alpha, float limit)",
    "TmStoreKeys": "void (*)(const float* k, int64_t k_stride, int64_t t, int64_t kv_heads, int64_t head_dim, "
    "const int64_t* slots, void* k_cache, int64_t block_size)",
    "TmStoreValues": "void (*)(const float* v, int64_t v_stride, int64_t t, int64_t row, const int64_t* slots, "
    "void* v_cache)",
    "TmLoraAdd": "int (*)(int dtype, const float* x, int64_t in, const TmLoraBatch* batch, const uint8_t* a, "
    "const uint8_t* bt, const int64_t* ranks, int64_t max_rank, int64_t parts, const int64_t* part_rows, "
    "int64_t out, float* y, float* scratch, int threads)",
    "TmMoeRoute": "void (*)(const float* logits, int64_t t, int64_t experts, int64_t top_k, int64_t routing, "
    "float* weights, int64_t* ids)",
    "TmMoeRouteGrouped": "void (*)(const float* logits, int64_t t, int64_t experts, int64_t top_k, "
    "const float* score_bias, int64_t n_group, int64_t topk_group, int64_t renormalize, float scaling, float* weights, "
    "int64_t* ids)",
    "TmMoeWorkspace": "int64_t (*)(const TmExperts* e, int64_t t, int threads)",
    "TmMoeMlp": "int (*)(const TmExperts* e, const float* x, int64_t t, const int64_t* ids, const float* weights, "
    "float* workspace, float* out, int threads)",
    # paged_attention.cpp's tm_paged_attention_window (window 0, softcap 0 and no sinks: tm_paged_attention's work).
    "TmAttention": "int (*)(const float* q, int64_t t, int64_t heads, int64_t kv_heads, int64_t head_dim, "
    "const void* k_cache, const void* v_cache, int64_t block_size, const int64_t* positions, "
    "const int64_t* seq_of_token, const int64_t* tables, int64_t table_width, float scale, int64_t window, "
    "float softcap, const float* sinks, float* out, int threads)",
    # latent_attention.cpp's tm_latent_attention (the caches untyped: float32 or float16).
    "TmLatentAttention": "int (*)(const float* q_nope, int64_t nope_t, int64_t nope_h, const float* q_rope, "
    "int64_t rope_t, int64_t rope_h, int64_t t, int64_t heads, int64_t nope, int64_t latent, int64_t rope, int64_t v, "
    "const float* w_uk, int64_t uk_h, int64_t uk_n, const float* w_uv, int64_t uv_h, int64_t uv_l, int64_t uv_v, "
    "const void* latent_cache, const void* rope_cache, int64_t block_size, const int64_t* positions, "
    "const int64_t* seq_of_token, const int64_t* tables, int64_t table_width, float scale, float* out, int threads)",
}

# The decoder stack's structs, in declaration order: (C type, field name) each.
STRUCTS: dict[str, tuple[tuple[str, str], ...]] = {
    # One linear layer: its product kernel and the weights it reads ([out_features, in_features]),
    # and its LoRA adapter slots (worker/layers/lora/slots.py; null: none), in lora_dtype (LORA_DTYPES): A [slots,
    # parts, lora_rank, in_features] and B transposed [slots, lora_rank, out_features], the scale folded into
    # B; lora_ranks [slots, parts]: the rank each slot's adapter has in each part (0: not targeted), of
    # which rows are read; part p's output rows (lora_part_rows[2p] on, lora_part_rows[2p + 1] of them)
    # are the product of A's block p.
    "TmLinear": (
        ("TmGemm", "gemm"),
        ("const uint8_t*", "weights"),
        ("int64_t", "fmt"),
        ("int64_t", "out_features"),
        ("const uint8_t*", "lora_a"),
        ("const uint8_t*", "lora_bt"),
        ("const int64_t*", "lora_ranks"),
        ("int64_t", "lora_rank"),
        ("int64_t", "lora_parts"),
        ("const int64_t*", "lora_part_rows"),
        ("int64_t", "lora_dtype"),
        ("const float*", "bias"),  # [out_features] float32, added after the product and its adapters (null: none)
    ),
    # A decoder layer: its MLP dense (gate_up, down) or, where ``experts`` is set, a mixture of experts:
    # the router's product (``router``, [experts, hidden]), its choice (``routing``: ROUTING_MODES) and the
    # experts (moe_mlp.cpp's). q_norm / k_norm: the q and k RMSNorm weights where the stack's ``qk_norm``
    # says the family has them. Attention: within ``window`` keys (0: the whole context), scores soft-capped
    # at ``softcap`` (0: none), a sink logit per head (``sinks`` [heads], null: none), as
    # tm_paged_attention_window takes them. Gemma's sandwich norms: ``attn_out_norm`` on o's output and
    # ``mlp_out_norm`` on the MLP's, each before its residual add (null: none; ``post_norm`` is then the
    # pre-feedforward norm). ``cos_table`` / ``sin_table``: the layer's rotary tables where they are not the
    # stack's (Gemma 3's local and global layers; null: the stack's).
    "TmLayer": (
        ("const float*", "input_norm"),  # [hidden]
        ("const float*", "post_norm"),  # [hidden]
        ("TmLinear", "qkv"),
        ("TmLinear", "o"),
        ("TmLinear", "gate_up"),
        ("TmLinear", "down"),
        ("const float*", "q_norm"),  # [heads * head_dim] (the whole projection) or [head_dim] (per head)
        ("const float*", "k_norm"),  # [kv_heads * head_dim] or [head_dim]
        ("TmLinear", "router"),
        ("const TmExperts*", "experts"),  # null: a dense MLP
        ("int64_t", "routing"),
        ("int64_t", "window"),
        ("float", "softcap"),
        ("const float*", "sinks"),
        ("const float*", "attn_out_norm"),  # [hidden]
        ("const float*", "mlp_out_norm"),  # [hidden]
        ("const float*", "cos_table"),  # [positions, rotary_dim / 2]
        ("const float*", "sin_table"),
        # Multi-head latent attention (DeepSeek's; the stack's ``latent`` set): ``qkv`` is then the query
        # projection (q_proj, or q_b_proj after ``q_a`` and its norm ``q_a_norm`` [q_lora_rank] where ``q_a``
        # has a kernel), ``kv_a`` kv_a_proj_with_mqa ([latent + rope, hidden]) whose latent ``kv_a_norm``
        # [latent] norms, and ``w_kv_b`` kv_b_proj's weight, float32 [heads, nope + v, latent] (w_uk its
        # first nope rows of each head, w_uv the rest, transposed).
        ("TmLinear", "q_a"),
        ("const float*", "q_a_norm"),
        ("TmLinear", "kv_a"),
        ("const float*", "kv_a_norm"),
        ("const float*", "w_kv_b"),
        # Grouped routing (``routing`` grouped): the score-correction bias [experts] (added for choosing only),
        # the groups, the groups kept and the weights' scale (routed_scaling_factor). A mixture-of-experts layer
        # whose ``gate_up`` has a kernel has shared experts too: that dense MLP on every token, its output
        # added to the routed sum.
        ("const float*", "score_bias"),
        ("int64_t", "n_group"),
        ("int64_t", "topk_group"),
        ("float", "route_scale"),
    ),
    "TmStack": (
        *(("int64_t", name) for name in ("num_layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate")),
        ("float", "eps"),
        ("float", "scale"),
        ("const float*", "cos_table"),  # [positions, rotary_dim / 2]
        ("const float*", "sin_table"),
        ("const float*", "final_norm"),  # [hidden]
        ("const TmLayer*", "layers"),
        ("TmRmsNorm", "rms_norm"),
        ("TmRotary", "rotary"),
        ("TmSiluAndMul", "activation"),  # the dense MLP's (ACTIVATIONS): SiLU-and-mul or GeGLU, one signature
        ("TmStoreKeys", "store_keys"),
        ("TmStoreValues", "store_values"),
        ("TmAttention", "attention"),
        # The LoRA products (lora.cpp's tm_lora_add; null when no layer has adapter slots) and the largest
        # lora_parts * lora_rank (the shrunk rows' width).
        ("TmLoraAdd", "lora_add"),
        ("int64_t", "lora_width"),
        # q/k RMSNorm between the projection and rotary (QK_NORM_MODES: none, over the whole projection as
        # OLMoE, or over each head as Qwen3), and the mixture-of-experts kernels (moe_mlp.cpp's; null when no
        # layer has experts) with the largest top_k of the layers'.
        ("int64_t", "qk_norm"),
        ("TmMoeRoute", "moe_route"),
        ("TmMoeWorkspace", "moe_workspace"),
        ("TmMoeMlp", "moe_mlp"),
        ("int64_t", "max_top_k"),
        # The dims of each head rotary turns (its first; the stack's tables and the layers' own are
        # [positions, rotary_dim / 2]): head_dim, or fewer (partial rotary, Phi-4-mini's).
        ("int64_t", "rotary_dim"),
        # Each sub-layer's output times this before its residual add (Granite's residual_multiplier; 1: none).
        ("float", "residual_multiplier"),
        # Multi-head latent attention (every layer's; 0: none): the latent's dims (kv_lora_rank), each head's
        # plain query dims (qk_nope_head_dim; its rotary ones are head_dim = rotary_dim) and value dims, the
        # latent norms' epsilon, whether the rotary dims come as interleaved pairs (de-interleaved before
        # rotating, as DeepSeek's rotary does), the kernel (latent_attention.cpp's) and the grouped router
        # (moe_mlp.cpp's tm_moe_route_grouped; null: no layer routes so).
        ("int64_t", "latent"),
        ("int64_t", "nope"),
        ("int64_t", "v_head_dim"),
        ("float", "latent_eps"),
        ("int64_t", "rope_interleave"),
        ("TmLatentAttention", "latent_attention"),
        ("TmMoeRouteGrouped", "moe_route_grouped"),
    ),
    # A mixture-of-experts layer's experts held by a rank (moe_mlp.cpp): experts first .. first + count - 1
    # of num_experts, each a gate/up product ([2 * width, hidden], gate rows then up rows) and down product
    # ([hidden, width]), top_k of them a token; each product's bias (float32 [2 * width] / [hidden]) added
    # after it where the family has them (gpt-oss); the activation SiLU-and-mul, or gpt-oss's clamped SwiGLU
    # (elementwise.cpp's tm_clamped_swiglu_and_mul with swiglu_alpha and swiglu_limit) where it is set.
    "TmExperts": (
        *(("int64_t", name) for name in ("hidden", "width", "top_k", "num_experts", "first", "count")),
        ("const TmLinear*", "gate_up"),  # [count]
        ("const TmLinear*", "down"),  # [count]
        ("TmSiluAndMul", "silu_and_mul"),
        ("const float* const*", "gate_up_bias"),  # [count] (null: no biases; an entry null: none)
        ("const float* const*", "down_bias"),  # [count] (null: no biases; an entry null: none)
        ("TmClampedSwiglu", "clamped_swiglu"),  # null: SiLU-and-mul
        ("float", "swiglu_alpha"),
        ("float", "swiglu_limit"),
    ),
    # A KV-cache group's step (worker/engine/kv_cache_groups.py): each new token's cache slot [t] and every
    # sequence's block table [sequences, table_width] in this group's blocks.
    "TmKvGroup": (
        ("const int64_t*", "slots"),
        ("const int64_t*", "tables"),
        ("int64_t", "table_width"),
    ),
    # A step's tokens by LoRA adapter slot: group g is slot slots[g], its token rows
    # rows[offsets[g] .. offsets[g + 1]).
    "TmLoraBatch": (
        ("int64_t", "groups"),
        ("const int64_t*", "slots"),
        ("const int64_t*", "offsets"),
        ("const int64_t*", "rows"),
    ),
}

_SCALARS: dict[str, type[ctypes._SimpleCData]] = {  # type: ignore[type-arg]
    "int": ctypes.c_int,
    "int64_t": ctypes.c_int64,
    "float": ctypes.c_float,
}
_SIGNATURE = re.compile(r"^(\w+) (\w+)\((.*)\)$")


def _ctype(c_type: str) -> type:
    """The ctypes type of a C type: every pointer (data or function) a void pointer."""
    c_type = c_type.removeprefix("const ").strip()
    if c_type.endswith("*") or c_type in FUNCTION_POINTERS:
        return ctypes.c_void_p
    if c_type in STRUCTS:
        return structure(c_type)
    return _SCALARS[c_type]


def _parse(signature: str) -> tuple[str, str, list[str]]:
    """'int tm_f(int a, const float* x)' -> ('int', 'tm_f', ['int', 'const float*'])."""
    m = _SIGNATURE.match(signature)
    assert m is not None, signature
    params = [p.strip().rsplit(" ", 1)[0] for p in m.group(3).split(",")]
    return m.group(1), m.group(2), params


@functools.cache
def structure(name: str) -> type[ctypes.Structure]:
    """The ctypes Structure of struct ``name``, field for field."""
    fields = [(field, _ctype(c_type)) for c_type, field in STRUCTS[name]]
    return type(name, (ctypes.Structure,), {"_fields_": fields})


def bind(lib: ctypes.CDLL, library: str) -> ctypes.CDLL:
    """Set the argument and return types of every function ``library`` exports, from ``FUNCTIONS``."""
    for signature in FUNCTIONS[library]:
        ret, name, params = _parse(signature)
        fn = getattr(lib, name)
        fn.argtypes = [_ctype(p) for p in params]
        fn.restype = None if ret == "void" else _ctype(ret)
    return lib


def header() -> str:
    """The C header every kernel source includes (``#include "tm_abi.h"``)."""
    lines = [
        "// Generated by worker/kernels/cpu/abi.py at build time (do not edit): the block formats, the decoder",
        "// stack's structs and every exported function's prototype, shared with the ctypes bindings.",
        "#pragma once",
        "#include <stddef.h>",
        "#include <stdint.h>",
        "",
        "// Every GGUF block format (abi.py's BLOCK_FORMATS); the kernels read the ones asserted to be in",
        "// blocks of TM_QK weights, the others are dequantized in torch.",
        f"#define TM_QK {QUANT_BLOCK}",
        f"#define TM_KQUANT_MIXED {KQUANT_MIXED}",
        f"#define TM_KQUANT_MAX_SEGMENTS {KQUANT_MAX_SEGMENTS}",
        f"#define TM_KQUANT_HEADER_BYTES {KQUANT_HEADER_BYTES}",
    ]
    lines += [f"#define TM_LORA_{name.upper()} {value}" for name, value in LORA_DTYPES.items()]
    lines += [f"#define TM_QK_NORM_{name.upper()} {value}" for name, value in QK_NORM_MODES.items()]
    lines += [f"#define TM_ROUTING_{name.upper()} {value}" for name, value in ROUTING_MODES.items()]
    for f in BLOCK_FORMATS:
        lines += [
            f"#define TM_FORMAT_{f.name} {f.id}",
            f"#define TM_BLOCK_WEIGHTS_{f.name} {f.block_weights}",
            f"#define TM_BLOCK_BYTES_{f.name} {f.block_bytes}",
        ]
        if f.kernel == "blocks":  # these kernels walk every format they read in blocks of TM_QK weights
            lines.append(f'static_assert(TM_BLOCK_WEIGHTS_{f.name} == TM_QK, "{f.name}: not in blocks of TM_QK");')
        elif f.kernel == "kquant":
            lines.append(f'static_assert(TM_BLOCK_WEIGHTS_{f.name} == {SUPER_BLOCK}, "{f.name}: not a super-block");')
    lines += [
        "",
        "// The formats as the kernels name them, and the bytes per block of those each family reads (0: another):",
        "// tm_native_block_bytes for block_gemm.cpp and vnni_gemm.cpp, tm_kquant_block_bytes for kquant_gemm.cpp.",
        "enum TmFormat : int {",
        *(f"  {f.name} = TM_FORMAT_{f.name}," for f in BLOCK_FORMATS),
        "};",
    ]
    for function, kernel in (("tm_native_block_bytes", "blocks"), ("tm_kquant_block_bytes", "kquant")):
        lines += [f"constexpr int64_t {function}(int fmt) {{", "  switch (fmt) {"]
        lines += [f"    case {f.name}: return TM_BLOCK_BYTES_{f.name};" for f in BLOCK_FORMATS if f.kernel == kernel]
        lines += ["    default: return 0;", "  }", "}"]
    lines += ["", 'extern "C" {', ""]
    lines += [f"struct {name};" for name in STRUCTS]  # the pointer types may point at them
    for name, pointer in FUNCTION_POINTERS.items():
        lines.append(f"typedef {pointer.replace('(*)', f'(*{name})', 1)};")
    for name, fields in STRUCTS.items():
        lines += ["", f"struct {name} {{", *(f"  {c_type} {field};" for c_type, field in fields), "};"]
        layout = structure(name)
        lines.append(f'static_assert(sizeof({name}) == {ctypes.sizeof(layout)}, "{name}: size differs from ctypes");')
        for _, field in fields:
            offset = getattr(layout, field).offset
            lines.append(f'static_assert(offsetof({name}, {field}) == {offset}, "{name}.{field}: offset differs");')
    for library, signatures in FUNCTIONS.items():
        lines += ["", f"// {library}.cpp", *(f"{signature};" for signature in signatures)]
    lines += ["", '}  // extern "C"', ""]
    return "\n".join(lines)
