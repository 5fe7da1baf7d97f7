// A Llama-architecture decoder stack in one native call: every layer's norms (q/k norms where the
// family has them), products, rotary, cache writes, attention and MLP (dense, or a mixture of experts),
// then the final norm. The same work the model's Python forward
// does, through the same kernels (their entry points come from their own libraries, passed in by
// decoder_stack.py), in the same order on the same inputs: so the same bits, without some 15
// Python-level calls and tensor allocations per layer, which at one decoding sequence cost more
// than the layer's arithmetic.
// LoRA adapters ride along as the eager layers add them (worker/layers/lora/slots.py): after a layer's
// product, lora.cpp's kernel (passed in) shrinks each adapter slot's tokens by each projection's block
// of A, expands them by that projection's columns of B.T and adds the delta to the product's rows
// (each row's bits independent of the rows beside it): the same kernel on the same rows, so the same
// bits as the eager path.
// A projection's bias (TmLinear.bias: the attention's of Qwen2 and gpt-oss, gpt-oss's router's) is added
// after the product and its adapters, one rounding each, as the eager layer's ``y + self.bias``.
// Attention takes each layer's sliding window, soft cap and sinks (tm_paged_attention_window; without
// them it is tm_paged_attention's work). With KV-cache groups (worker/engine/kv_cache_groups.py) each layer
// reads its group's slots and block tables and its storage tensor of the caches (``layer_kv``).
// Gemma's layers: the dense MLP's activation is the stack's (SiLU-and-mul, or Gemma's GeGLU), o's output and
// the MLP's are each RMS-normed before their residual add where the layer has those norms (attn_out_norm,
// mlp_out_norm: tm_rms_norm in place, the rows the eager norm reads), and a layer may rotate with its own
// tables (Gemma 3's local and global layers).
// Rotary turns the first rotary_dim dims of each head (all of them, or Phi-4-mini's partial rotary: the
// rest pass through, as the eager rotary's views of the first dims leave them). Granite's residual
// multiplier scales attention's output and the MLP's before their residual adds (scale_branch).
// DeepSeek-V3's layers (s->latent set): multi-head latent attention in place of the q/k/v attention, as
// worker/models/deepseek_v3.py's DeepseekV3Attention runs it under the native ops (latent_attention_layer below);
// a mixture-of-experts layer routes by groups (moe_mlp.cpp's tm_moe_route_grouped) and adds its shared
// experts' dense MLP (the layer's gate_up / down) to the routed sum; its first layers are dense.
// Built and loaded by worker/kernels/cpu/build.py, once per instruction set (plain C++: the kernels it calls carry
// the vector work, each the same bits on every CPU).

#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <chrono>

#include "tm_abi.h"  // TmLinear, TmLayer, TmStack, the kernels' pointer types and this file's prototypes

// Where a step's time goes inside the stack, for bench/step_breakdown.py: with TM_STACK_PROFILE=1 in the
// worker's environment, the nanoseconds spent in the products (their adapters and biases with them), in
// attention's kernel, in the experts, and in the whole call, summed until tm_stack_profile reads them. Off
// (the default) each timed call costs one branch on a constant.
namespace {
enum Phase { PRODUCTS, ATTENTION, EXPERTS, STACK, PHASES };
int64_t profile_ns[PHASES];
int64_t profile_calls;
const bool profiling = [] {
  const char* v = getenv("TM_STACK_PROFILE");
  return v != nullptr && *v != '\0' && strcmp(v, "0") != 0;
}();

struct Timed {
  Phase phase;
  std::chrono::steady_clock::time_point start;
  explicit Timed(Phase p) : phase(p) {
    if (profiling) start = std::chrono::steady_clock::now();
  }
  ~Timed() {
    if (profiling)
      profile_ns[phase] +=
          std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
  }
};
}  // namespace

// f(r0, r1) over rows [0, t) of `width` floats each, split between the threads where there is enough of them:
// the per-token operations (norms, rotary, cache writes, the MLP's activation) compute every row on its own in an
// order fixed by the row alone, so a row's bits do not depend on the split. Below ROWS_IN_PARALLEL floats (a
// decoding step's few rows) the fork would cost more than the work, and one thread takes them; past it, a prompt's
// 512 rows on one core were 5-7 % of its time (bench/kernels/prefill_profile.py), with the other thread waiting.
// TM_STACK_SPLIT_FROM in the environment sets the floats from which they split (the tests' tiny models split
// every step's rows with 1, tests/kernels/test_decoder_stack.py).
static const int64_t ROWS_IN_PARALLEL = [] {
  const char* v = getenv("TM_STACK_SPLIT_FROM");
  return v != nullptr && *v != '\0' ? atoll(v) : (int64_t)1 << 16;
}();
template <class F>
static void by_rows(int64_t t, int64_t width, int threads, F f) {
  if (threads <= 1 || t < 2 || t * width < ROWS_IN_PARALLEL) return f(0, t);
#pragma omp parallel num_threads(threads)
  {
    const int i = omp_get_thread_num(), n = omp_get_num_threads();
    const int64_t r0 = t * i / n, r1 = t * (i + 1) / n;
    if (r0 < r1) f(r0, r1);
  }
}

// tm_rms_norm over rows [0, t) by_rows: x's rows `x_stride` apart, residual's, h_out's and normed's d apart.
static void rms_norm_rows(const TmStack* s, const float* x, int64_t x_stride, const float* residual,
                          const float* weight, float* h_out, float* normed, int64_t t, int64_t d, int threads) {
  by_rows(t, d, threads, [&](int64_t r0, int64_t r1) {
    s->rms_norm(x + r0 * x_stride, x_stride, residual ? residual + r0 * d : nullptr, weight, s->eps, h_out + r0 * d,
                normed + r0 * d, r1 - r0, d);
  });
}

// s->rotary over rows [0, t) by_rows (rows `stride` apart, `heads` heads of D each).
static void rotary_rows(const TmStack* s, float* x, int64_t stride, int64_t t, int64_t heads, int64_t D, int64_t R,
                        const int64_t* positions, const float* cos_t, const float* sin_t, int threads) {
  by_rows(t, heads * D, threads, [&](int64_t r0, int64_t r1) {
    s->rotary(x + r0 * stride, stride, r1 - r0, heads, D, R, positions + r0, cos_t, sin_t);
  });
}

// The MLP's activation over rows [0, t) by_rows: gate_up's rows 2 W apart (gate, then up), act's W.
static void activation_rows(const TmStack* s, const float* gate_up, float* act, int64_t t, int64_t W, int threads) {
  by_rows(t, W, threads,
          [&](int64_t r0, int64_t r1) { s->activation(gate_up + r0 * 2 * W, act + r0 * W, r1 - r0, W); });
}

// Floats of scratch the LoRA products of t tokens need: the shrunk rows, parts * rank each.
static int64_t lora_scratch(const TmStack* s, int64_t t) {
  if (!s->lora_add) return 0;
  return t * s->lora_width;
}

// y [t, L.out_features] += each adapter token's delta (x [t, in] through its slot's A and B).
static int add_lora(const TmStack* s, const TmLinear& L, const TmLoraBatch* lora, const float* x, int64_t in,
                    float* y, float* scratch, int threads) {
  if (!lora || !L.lora_a) return 0;
  return s->lora_add((int)L.lora_dtype, x, in, lora, L.lora_a, L.lora_bt, L.lora_ranks, L.lora_rank, L.lora_parts,
                     L.lora_part_rows, L.out_features, y, scratch, threads) != 0;
}

// y [t, L.out_features] = x [t, in] @ L's weights.T, plus its adapters' deltas, plus its bias: the eager
// layer's product, LoRA and ``y + self.bias``. Nonzero when a kernel fails.
static int linear(const TmStack* s, const TmLinear& L, const TmLoraBatch* lora, const float* x, int64_t t,
                  int64_t in, float* y, float* scratch, int threads) {
  const Timed timed(PRODUCTS);
  if (L.gemm((int)L.fmt, x, t, in, L.weights, L.out_features, y, threads)) return 1;
  if (add_lora(s, L, lora, x, in, y, scratch, threads)) return 1;
  if (L.bias) {
    const int64_t n = L.out_features;
    for (int64_t i = 0; i < t; ++i)
      for (int64_t j = 0; j < n; ++j) y[i * n + j] = y[i * n + j] + L.bias[j];
  }
  return 0;
}

// The largest expert count and expert workspace of the stack's mixture-of-experts layers (0: none).
static void moe_sizes(const TmStack* s, int64_t t, int threads, int64_t* experts, int64_t* workspace) {
  *experts = 0;
  *workspace = 0;
  for (int64_t l = 0; l < s->num_layers; ++l) {
    const TmExperts* e = s->layers[l].experts;
    if (!e) continue;
    if (e->num_experts > *experts) *experts = e->num_experts;
    const int64_t w = s->moe_workspace(e, t, threads);
    if (w > *workspace) *workspace = w;
  }
}

// The widest dense MLP of the stack's layers (a layer's own gate_up: the dense layers', shared experts').
static int64_t widest_mlp(const TmStack* s) {
  int64_t width = s->intermediate;
  for (int64_t l = 0; l < s->num_layers; ++l) {
    const int64_t w = s->layers[l].gate_up.out_features / 2;
    if (w > width) width = w;
  }
  return width;
}

// Floats a latent-attention layer's step of t tokens needs (0: the stack has none): the queries, q_a's
// product, norm and sums, kv_a's product, the normed latents and their sums, the rotary queries and keys,
// attention's output.
static int64_t latent_floats(const TmStack* s, int64_t t) {
  if (!s->latent) return 0;
  int64_t q_lora = 0;
  for (int64_t l = 0; l < s->num_layers; ++l)
    if (s->layers[l].q_a.out_features > q_lora) q_lora = s->layers[l].q_a.out_features;
  const int64_t H = s->heads, R = s->head_dim, Lt = s->latent;
  return t * (H * (s->nope + R) + 3 * q_lora + (Lt + R) + 2 * Lt + H * R + R + H * s->v_head_dim);
}

// Multi-head latent attention of layer L on the normed rows x [t, hidden], into y [t, hidden]: the
// query (q_proj, or q_b_proj on q_a_proj's normed product), kv_a_proj_with_mqa's latent normed and its
// rotary key; the rotary dims of each head's query and the key de-interleaved where the family's are
// interleaved, then rotated; the latents and rotary keys stored (the value store's rows: as
// NativeCpuOps.store_latent writes them); latent_attention.cpp on the query's plain dims (w_uk and w_uv
// views of kv_b_proj's weight, the eager layer's strides) and its rotated ones; o_proj. Each as
// DeepseekV3Attention's project and attend call them under the native ops, on the same values.
static int latent_attention_layer(const TmStack* s, const TmLayer& L, const TmLoraBatch* lora, const float* x,
                                  int64_t t, const int64_t* positions, const int64_t* seq_of_token,
                                  const TmKvGroup& g, uint8_t* kc, uint8_t* vc, int64_t block_size,
                                  const float* cos_t, const float* sin_t, float* ws, float* y, float* scratch,
                                  int threads) {
  const int64_t Hd = s->hidden, H = s->heads, R = s->head_dim, N = s->nope, V = s->v_head_dim, Lt = s->latent;
  const int64_t QK = N + R, QR = L.q_a.out_features;
  float* q = ws;                   // [t, H, N + R]
  float* qa = q + t * H * QK;      // q_a's product, its norm's sums, the normed [t, QR] each
  float* qa_sums = qa + t * QR;
  float* qa_normed = qa_sums + t * QR;
  float* kv = qa_normed + t * QR;  // [t, Lt + R]
  float* lat_sums = kv + t * (Lt + R);
  float* lat = lat_sums + t * Lt;  // the normed latents [t, Lt]
  float* q_rope = lat + t * Lt;    // [t, H, R]
  float* k_rope = q_rope + t * H * R;  // [t, R]
  float* out = k_rope + t * R;     // attention's [t, H, V]
  if (L.q_a.gemm) {
    if (linear(s, L.q_a, lora, x, t, Hd, qa, scratch, threads)) return 1;
    s->rms_norm(qa, QR, nullptr, L.q_a_norm, s->latent_eps, qa_sums, qa_normed, t, QR);
    if (linear(s, L.qkv, lora, qa_normed, t, QR, q, scratch, threads)) return 1;
  } else if (linear(s, L.qkv, lora, x, t, Hd, q, scratch, threads)) {
    return 1;
  }
  if (linear(s, L.kv_a, lora, x, t, Hd, kv, scratch, threads)) return 1;
  s->rms_norm(kv, Lt + R, nullptr, L.kv_a_norm, s->latent_eps, lat_sums, lat, t, Lt);
  // The rotary dims, in the order rotary turns them: even dims then odd ones where interleaved.
  const int64_t half = R / 2;
  for (int64_t i = 0; i < t; ++i) {
    for (int64_t h = 0; h <= H; ++h) {  // the heads' queries, then (h == H) the key
      const float* src = h < H ? q + (i * H + h) * QK + N : kv + i * (Lt + R) + Lt;
      float* dst = h < H ? q_rope + (i * H + h) * R : k_rope + i * R;
      if (s->rope_interleave) {
        for (int64_t j = 0; j < half; ++j) {
          dst[j] = src[2 * j];
          dst[half + j] = src[2 * j + 1];
        }
      } else {
        memcpy(dst, src, R * sizeof(float));
      }
    }
  }
  s->rotary(q_rope, H * R, t, H, R, R, positions, cos_t, sin_t);
  s->rotary(k_rope, R, t, 1, R, R, positions, cos_t, sin_t);
  s->store_values(lat, Lt, t, Lt, g.slots, kc);
  s->store_values(k_rope, R, t, R, g.slots, vc);
  const int64_t uk_h = (N + V) * Lt;
  const int rc = [&] {
    const Timed timed(ATTENTION);
    return s->latent_attention(q, H * QK, QK, q_rope, H * R, R, t, H, N, Lt, R, V, L.w_kv_b, uk_h, Lt, L.w_kv_b + N * Lt,
                          uk_h, 1, Lt, kc, vc, block_size, positions, seq_of_token, g.tables, g.table_width,
                          s->scale, out, threads);
  }();
  if (rc) return 2;
  return linear(s, L.o, lora, out, t, H * V, y, scratch, threads);
}

// A sub-layer's output y [t, hidden] times the residual multiplier (Granite's), before its residual add:
// each value one float32 product, rounded, as the eager layer's ``x * self.residual_multiplier``.
static void scale_branch(const TmStack* s, float* y, int64_t t) {
  const float m = s->residual_multiplier;
  if (m == 1.0f) return;  // (y * 1 is y)
  const int64_t n = t * s->hidden;
  for (int64_t i = 0; i < n; ++i) y[i] = y[i] * m;
}

extern "C" {

// Floats of workspace a step of t tokens needs (with `threads` threads: the experts' share depends on it).
int64_t tm_stack_workspace(const TmStack* s, int64_t t, int threads) {
  const int64_t q = s->heads * s->head_dim, kv = s->kv_heads * s->head_dim;
  int64_t experts, moe;
  moe_sizes(s, t, threads, &experts, &moe);
  const int64_t qk_norm = s->qk_norm != TM_QK_NORM_NONE ? t * (q + kv) : 0;  // its rows' sums, normed keys
  // ids, weights, logits; the shared experts' output
  const int64_t routing = experts ? t * (3 * s->max_top_k + experts + s->hidden) + moe : 0;
  return t * (3 * s->hidden + (q + 2 * kv) + 2 * q + 3 * widest_mlp(s)) + lora_scratch(s, t) + qk_norm + routing +
         latent_floats(s, t);
}

// x: the embeddings [t, hidden]; out: the final norm's output [t, hidden]. positions, seq_of_token: [t];
// groups: each KV-cache group's slots [t] and block tables; layer_kv [layers][2]: each layer's group and
// storage tensor (null: one group, layer l in tensor l); the caches: [tensors][layer_bytes] (the values'
// [tensors][v_layer_bytes]: a latent layer's rotary keys) in the layouts paged_attention.cpp reads (keys
// transposed per block, values as [slot][kv_heads][D]; a latent layer's latents and rotary keys as
// [slot][dims] each, latent_attention.cpp's layout).
// Returns 0, or the first failing kernel's code: -100 - layer for a product, -200 - layer for
// attention, -300 - layer for the experts. lora: the step's tokens by adapter slot (null: the base
// model's products only).
// q/k norms (s->qk_norm): the same tm_rms_norm on the same rows as the model's before_rotary (OLMoE's
// over each token's whole q and k, Qwen3's over each head), into contiguous q and k that rotary,
// the cache and attention then read. A mixture-of-experts layer (L.experts): the router's product,
// moe_mlp.cpp's choice (tm_moe_route) and its experts (tm_moe_mlp), as worker/layers/fused_moe runs them
// under the native ops.
int tm_decoder_stack(const TmStack* s, const float* x, int64_t t, const int64_t* positions,
                     const int64_t* seq_of_token, const TmKvGroup* groups, const int64_t* layer_kv, uint8_t* k_cache,
                     uint8_t* v_cache, int64_t layer_bytes, int64_t v_layer_bytes, int64_t block_size,
                     const TmLoraBatch* lora, float* workspace, float* out, int threads) {
  const Timed whole(STACK);
  profile_calls += profiling;
  const int64_t H = s->hidden, D = s->head_dim, R = s->rotary_dim, I = widest_mlp(s), K = s->max_top_k;
  const int64_t q_size = s->heads * D, kv_size = s->kv_heads * D, qkv_size = q_size + 2 * kv_size;
  int64_t max_experts, moe_floats;
  moe_sizes(s, t, threads, &max_experts, &moe_floats);
  int64_t* ids = (int64_t*)workspace;  // the experts chosen [t, top_k] (first: 8-byte aligned)
  float* h = workspace + (max_experts ? 2 * t * K : 0);  // the residual stream [t, H]
  float* normed = h + t * H;     // [t, H]
  float* y = normed + t * H;     // a layer's output, o_proj's, down's or the experts' [t, H]
  float* qkv = y + t * H;        // [t, q + 2 kv]
  float* q = qkv + t * qkv_size; // the queries, contiguous [t, heads, D]
  float* attn = q + t * q_size;  // [t, heads * D]
  float* gate_up = attn + t * q_size;  // [t, 2 I]
  float* act = gate_up + t * 2 * I;    // [t, I]
  float* scratch = act + t * I;        // the LoRA products' (lora_scratch)
  float* keys = scratch + lora_scratch(s, t);  // normed keys [t, kv_heads, D] (with q/k norms)
  float* sums = keys + (s->qk_norm != TM_QK_NORM_NONE ? t * kv_size : 0);  // the q/k norms' h_out [t, q]
  float* route_w = sums + (s->qk_norm != TM_QK_NORM_NONE ? t * q_size : 0);  // the experts' weights [t, top_k]
  float* logits = route_w + (max_experts ? t * K : 0);  // the router's [t, experts]
  float* shared = logits + t * max_experts;             // the shared experts' output [t, H]
  float* moe_ws = shared + (max_experts ? t * H : 0);   // moe_mlp.cpp's workspace
  float* latent_ws = moe_ws + moe_floats;              // latent attention's (latent_floats)

  for (int64_t l = 0; l < s->num_layers; ++l) {
    const TmLayer& L = s->layers[l];
    const TmKvGroup& g = groups[layer_kv ? layer_kv[2 * l] : 0];
    const int64_t tensor = layer_kv ? layer_kv[2 * l + 1] : l;
    const int64_t* slots = g.slots;
    uint8_t* kc = k_cache + tensor * layer_bytes;
    uint8_t* vc = v_cache + tensor * v_layer_bytes;
    const float* cos_t = L.cos_table ? L.cos_table : s->cos_table;
    const float* sin_t = L.sin_table ? L.sin_table : s->sin_table;
    // Residual add (none before the first layer) and the input norm.
    if (l == 0) rms_norm_rows(s, x, H, nullptr, L.input_norm, h, normed, t, H, threads);
    else rms_norm_rows(s, y, H, h, L.input_norm, h, normed, t, H, threads);
    if (s->latent) {
      const int rc = latent_attention_layer(s, L, lora, normed, t, positions, seq_of_token, g, kc, vc, block_size,
                                            cos_t, sin_t, latent_ws, y, scratch, threads);
      if (rc) return rc == 2 ? -200 - (int)l : -100 - (int)l;
    } else {
      if (linear(s, L.qkv, lora, normed, t, H, qkv, scratch, threads)) return -100 - (int)l;
      if (s->qk_norm == TM_QK_NORM_NONE) {
        rotary_rows(s, qkv, qkv_size, t, s->heads, D, R, positions, cos_t, sin_t, threads);
        rotary_rows(s, qkv + q_size, qkv_size, t, s->kv_heads, D, R, positions, cos_t, sin_t, threads);
        by_rows(t, q_size + kv_size, threads, [&](int64_t r0, int64_t r1) {
          s->store_keys(qkv + r0 * qkv_size + q_size, qkv_size, r1 - r0, s->kv_heads, D, slots + r0, kc, block_size);
          for (int64_t i = r0; i < r1; ++i) memcpy(q + i * q_size, qkv + i * qkv_size, q_size * sizeof(float));
        });
      } else {
        if (s->qk_norm == TM_QK_NORM_WHOLE) {
          rms_norm_rows(s, qkv, qkv_size, nullptr, L.q_norm, sums, q, t, q_size, threads);
          rms_norm_rows(s, qkv + q_size, qkv_size, nullptr, L.k_norm, sums, keys, t, kv_size, threads);
        } else {  // each head a row
          by_rows(t, q_size + kv_size, threads, [&](int64_t r0, int64_t r1) {
            for (int64_t i = r0; i < r1; ++i) {  // each row's own stretch of the unused h_out (sums)
              const float* row = qkv + i * qkv_size;
              s->rms_norm(row, D, nullptr, L.q_norm, s->eps, sums + i * q_size, q + i * q_size, s->heads, D);
              s->rms_norm(row + q_size, D, nullptr, L.k_norm, s->eps, sums + i * q_size, keys + i * kv_size,
                          s->kv_heads, D);
            }
          });
        }
        rotary_rows(s, q, q_size, t, s->heads, D, R, positions, cos_t, sin_t, threads);
        rotary_rows(s, keys, kv_size, t, s->kv_heads, D, R, positions, cos_t, sin_t, threads);
        by_rows(t, kv_size, threads, [&](int64_t r0, int64_t r1) {
          s->store_keys(keys + r0 * kv_size, kv_size, r1 - r0, s->kv_heads, D, slots + r0, kc, block_size);
        });
      }
      by_rows(t, kv_size, threads, [&](int64_t r0, int64_t r1) {
        s->store_values(qkv + r0 * qkv_size + q_size + kv_size, qkv_size, r1 - r0, kv_size, slots + r0, vc);
      });
      const int rc = [&] {
        const Timed timed(ATTENTION);
        return s->attention(q, t, s->heads, s->kv_heads, D, kc, vc, block_size, positions, seq_of_token, g.tables,
                            g.table_width, s->scale, L.window, L.softcap, L.sinks, attn, threads);
      }();
      if (rc) return -200 - (int)l;
      if (linear(s, L.o, lora, attn, t, q_size, y, scratch, threads)) return -100 - (int)l;
    }
    // Gemma's norm of attention's output (its h_out, the rows themselves, written back in place).
    if (L.attn_out_norm) rms_norm_rows(s, y, H, nullptr, L.attn_out_norm, y, y, t, H, threads);
    scale_branch(s, y, t);
    rms_norm_rows(s, y, H, h, L.post_norm, h, normed, t, H, threads);
    if (L.experts) {
      const TmExperts* e = L.experts;
      if (linear(s, L.router, nullptr, normed, t, H, logits, scratch, threads)) return -100 - (int)l;
      if (L.routing >= TM_ROUTING_GROUPED)
        s->moe_route_grouped(logits, t, e->num_experts, e->top_k, L.score_bias, L.n_group, L.topk_group,
                             L.routing == TM_ROUTING_GROUPED_RENORMALIZED, L.route_scale, route_w, ids);
      else
        s->moe_route(logits, t, e->num_experts, e->top_k, L.routing, route_w, ids);
      const int rc = [&] {
        const Timed timed(EXPERTS);
        return s->moe_mlp(e, normed, t, ids, route_w, moe_ws, y, threads);
      }();
      if (rc) return -300 - (int)l;
      if (L.gate_up.gemm) {  // shared experts: their MLP on every token, added to the routed sum
        const int64_t W = L.gate_up.out_features / 2;
        if (linear(s, L.gate_up, lora, normed, t, H, gate_up, scratch, threads)) return -100 - (int)l;
        activation_rows(s, gate_up, act, t, W, threads);
        if (linear(s, L.down, lora, act, t, W, shared, scratch, threads)) return -100 - (int)l;
        for (int64_t i = 0; i < t * H; ++i) y[i] = y[i] + shared[i];
      }
    } else {
      const int64_t W = L.gate_up.out_features / 2;
      if (linear(s, L.gate_up, lora, normed, t, H, gate_up, scratch, threads)) return -100 - (int)l;
      activation_rows(s, gate_up, act, t, W, threads);
      if (linear(s, L.down, lora, act, t, W, y, scratch, threads)) return -100 - (int)l;
    }
    if (L.mlp_out_norm) rms_norm_rows(s, y, H, nullptr, L.mlp_out_norm, y, y, t, H, threads);  // Gemma's, as above
    scale_branch(s, y, t);
  }
  rms_norm_rows(s, y, H, h, s->final_norm, h, out, t, H, threads);
  return 0;
}

// The profile's sums since the last read (TM_STACK_PROFILE): out[0..3] nanoseconds in the products, attention,
// the experts and the whole stack, out[4] the stack's calls; all zero when not profiling. Resets them.
void tm_stack_profile(int64_t* out) {
  for (int p = 0; p < PHASES; ++p) out[p] = profile_ns[p], profile_ns[p] = 0;
  out[PHASES] = profile_calls;
  profile_calls = 0;
}
}
