// A Llama-architecture decoder stack in one native call: every layer's norms (q/k norms where the
// family has them), products, rotary, cache writes, attention and MLP (dense, or a mixture of experts),
// then the final norm. The same work the model's Python forward
// does, through the same kernels (their entry points come from their own libraries, passed in by
// decoder_stack.py), in the same order on the same inputs: so the same bits, without some 15
// Python-level calls and tensor allocations per layer, which at one decoding sequence cost more
// than the layer's arithmetic.
// LoRA adapters ride along as the eager layers add them (layers/lora/slots.py): after a layer's
// product, lora.cpp's kernel (passed in) shrinks each adapter slot's tokens by each projection's block
// of A, expands them by that projection's columns of B.T and adds the delta to the product's rows
// (each row's bits independent of the rows beside it): the same kernel on the same rows, so the same
// bits as the eager path.
// A projection's bias (TmLinear.bias: the attention's of Qwen2 and gpt-oss, gpt-oss's router's) is added
// after the product and its adapters, one rounding each, as the eager layer's ``y + self.bias``.
// Attention takes each layer's sliding window, soft cap and sinks (tm_paged_attention_window; without
// them it is tm_paged_attention's work). With KV-cache groups (engine/kv_cache_groups.py) each layer
// reads its group's slots and block tables and its storage tensor of the caches (``layer_kv``).
// Gemma's layers: the dense MLP's activation is the stack's (SiLU-and-mul, or Gemma's GeGLU), o's output and
// the MLP's are each RMS-normed before their residual add where the layer has those norms (attn_out_norm,
// mlp_out_norm: tm_rms_norm in place, the rows the eager norm reads), and a layer may rotate with its own
// tables (Gemma 3's local and global layers).
// Rotary turns the first rotary_dim dims of each head (all of them, or Phi-4-mini's partial rotary: the
// rest pass through, as the eager rotary's views of the first dims leave them). Granite's residual
// multiplier scales attention's output and the MLP's before their residual adds (scale_branch).
// Built and loaded by kernels/cpu/build.py (g++ -O3 -march=native -fopenmp).

#include <stdint.h>
#include <string.h>

#include "tm_abi.h"  // TmLinear, TmLayer, TmStack, the kernels' pointer types and this file's prototypes

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
  const int64_t routing = experts ? t * (3 * s->max_top_k + experts) + moe : 0;  // ids, weights, logits
  return t * (3 * s->hidden + (q + 2 * kv) + 2 * q + 3 * s->intermediate) + lora_scratch(s, t) + qk_norm + routing;
}

// x: the embeddings [t, hidden]; out: the final norm's output [t, hidden]. positions, seq_of_token: [t];
// groups: each KV-cache group's slots [t] and block tables; layer_kv [layers][2]: each layer's group and
// storage tensor (null: one group, layer l in tensor l); the caches: [tensors][layer_bytes] in the
// layouts paged_attention.cpp reads (keys transposed per block, values as [slot][kv_heads][D]).
// Returns 0, or the first failing kernel's code: -100 - layer for a product, -200 - layer for
// attention, -300 - layer for the experts. lora: the step's tokens by adapter slot (null: the base
// model's products only).
// q/k norms (s->qk_norm): the same tm_rms_norm on the same rows as the model's before_rotary (OLMoE's
// over each token's whole q and k, Qwen3's over each head), into contiguous q and k that rotary,
// the cache and attention then read. A mixture-of-experts layer (L.experts): the router's product,
// moe_mlp.cpp's choice (tm_moe_route) and its experts (tm_moe_mlp), as layers/fused_moe runs them
// under the native ops.
int tm_decoder_stack(const TmStack* s, const float* x, int64_t t, const int64_t* positions,
                     const int64_t* seq_of_token, const TmKvGroup* groups, const int64_t* layer_kv, uint8_t* k_cache,
                     uint8_t* v_cache, int64_t layer_bytes, int64_t block_size, const TmLoraBatch* lora,
                     float* workspace, float* out, int threads) {
  const int64_t H = s->hidden, D = s->head_dim, R = s->rotary_dim, I = s->intermediate, K = s->max_top_k;
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
  float* moe_ws = logits + t * max_experts;             // moe_mlp.cpp's workspace

  for (int64_t l = 0; l < s->num_layers; ++l) {
    const TmLayer& L = s->layers[l];
    const TmKvGroup& g = groups[layer_kv ? layer_kv[2 * l] : 0];
    const int64_t tensor = layer_kv ? layer_kv[2 * l + 1] : l;
    const int64_t* slots = g.slots;
    uint8_t* kc = k_cache + tensor * layer_bytes;
    uint8_t* vc = v_cache + tensor * layer_bytes;
    const float* cos_t = L.cos_table ? L.cos_table : s->cos_table;
    const float* sin_t = L.sin_table ? L.sin_table : s->sin_table;
    // Residual add (none before the first layer) and the input norm.
    if (l == 0) s->rms_norm(x, H, nullptr, L.input_norm, s->eps, h, normed, t, H);
    else s->rms_norm(y, H, h, L.input_norm, s->eps, h, normed, t, H);
    if (linear(s, L.qkv, lora, normed, t, H, qkv, scratch, threads)) return -100 - (int)l;
    if (s->qk_norm == TM_QK_NORM_NONE) {
      s->rotary(qkv, qkv_size, t, s->heads, D, R, positions, cos_t, sin_t);
      s->rotary(qkv + q_size, qkv_size, t, s->kv_heads, D, R, positions, cos_t, sin_t);
      s->store_keys(qkv + q_size, qkv_size, t, s->kv_heads, D, slots, kc, block_size);
      for (int64_t i = 0; i < t; ++i) memcpy(q + i * q_size, qkv + i * qkv_size, q_size * sizeof(float));
    } else {
      if (s->qk_norm == TM_QK_NORM_WHOLE) {
        s->rms_norm(qkv, qkv_size, nullptr, L.q_norm, s->eps, sums, q, t, q_size);
        s->rms_norm(qkv + q_size, qkv_size, nullptr, L.k_norm, s->eps, sums, keys, t, kv_size);
      } else {  // each head a row
        for (int64_t i = 0; i < t; ++i) {
          const float* row = qkv + i * qkv_size;
          s->rms_norm(row, D, nullptr, L.q_norm, s->eps, sums, q + i * q_size, s->heads, D);
          s->rms_norm(row + q_size, D, nullptr, L.k_norm, s->eps, sums, keys + i * kv_size, s->kv_heads, D);
        }
      }
      s->rotary(q, q_size, t, s->heads, D, R, positions, cos_t, sin_t);
      s->rotary(keys, kv_size, t, s->kv_heads, D, R, positions, cos_t, sin_t);
      s->store_keys(keys, kv_size, t, s->kv_heads, D, slots, kc, block_size);
    }
    s->store_values(qkv + q_size + kv_size, qkv_size, t, kv_size, slots, vc);
    if (s->attention(q, t, s->heads, s->kv_heads, D, kc, vc, block_size, positions, seq_of_token, g.tables,
                     g.table_width, s->scale, L.window, L.softcap, L.sinks, attn, threads))
      return -200 - (int)l;
    if (linear(s, L.o, lora, attn, t, q_size, y, scratch, threads)) return -100 - (int)l;
    // Gemma's norm of attention's output (its h_out, the rows themselves, written back in place).
    if (L.attn_out_norm) s->rms_norm(y, H, nullptr, L.attn_out_norm, s->eps, y, y, t, H);
    scale_branch(s, y, t);
    s->rms_norm(y, H, h, L.post_norm, s->eps, h, normed, t, H);
    if (L.experts) {
      const TmExperts* e = L.experts;
      if (linear(s, L.router, nullptr, normed, t, H, logits, scratch, threads)) return -100 - (int)l;
      s->moe_route(logits, t, e->num_experts, e->top_k, L.routing, route_w, ids);
      if (s->moe_mlp(e, normed, t, ids, route_w, moe_ws, y, threads)) return -300 - (int)l;
    } else {
      if (linear(s, L.gate_up, lora, normed, t, H, gate_up, scratch, threads)) return -100 - (int)l;
      s->activation(gate_up, act, t, I);
      if (linear(s, L.down, lora, act, t, I, y, scratch, threads)) return -100 - (int)l;
    }
    if (L.mlp_out_norm) s->rms_norm(y, H, nullptr, L.mlp_out_norm, s->eps, y, y, t, H);  // Gemma's, as above
    scale_branch(s, y, t);
  }
  s->rms_norm(y, H, h, s->final_norm, s->eps, h, out, t, H);
  return 0;
}
}
