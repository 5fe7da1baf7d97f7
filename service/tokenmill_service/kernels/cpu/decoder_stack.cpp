// A Llama-architecture decoder stack in one native call: every layer's norms, products, rotary,
// cache writes, attention and MLP, then the final norm. The same work the model's Python forward
// does, through the same kernels (their entry points come from their own libraries, passed in by
// decoder_stack.py), in the same order on the same inputs: so the same bits, without some 15
// Python-level calls and tensor allocations per layer, which at one decoding sequence cost more
// than the layer's arithmetic.
// LoRA adapters ride along as the eager layers add them (layers/lora/slots.py): after a layer's
// product, lora.cpp's kernel (passed in) shrinks each adapter slot's tokens by each projection's block
// of A, expands them by that projection's columns of B.T and adds the delta to the product's rows
// (each row's bits independent of the rows beside it): the same kernel on the same rows, so the same
// bits as the eager path.
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

extern "C" {

// Floats of workspace a step of t tokens needs.
int64_t tm_stack_workspace(const TmStack* s, int64_t t) {
  const int64_t q = s->heads * s->head_dim, kv = s->kv_heads * s->head_dim;
  return t * (3 * s->hidden + (q + 2 * kv) + 2 * q + 3 * s->intermediate) + lora_scratch(s, t);
}

// x: the embeddings [t, hidden]; out: the final norm's output [t, hidden]. positions, slots,
// seq_of_token: [t]; tables: [sequences, table_width]; the caches: [layers][layer_bytes] in the
// layouts paged_attention.cpp reads (keys transposed per block, values as [slot][kv_heads][D]).
// Returns 0, or the first failing kernel's code: -100 - layer for a product, -200 - layer for
// attention. lora: the step's tokens by adapter slot (null: the base model's products only).
int tm_decoder_stack(const TmStack* s, const float* x, int64_t t, const int64_t* positions, const int64_t* slots,
                     const int64_t* seq_of_token, const int64_t* tables, int64_t table_width, uint8_t* k_cache,
                     uint8_t* v_cache, int64_t layer_bytes, int64_t block_size, const TmLoraBatch* lora, float* workspace, float* out,
                     int threads) {
  const int64_t H = s->hidden, D = s->head_dim, I = s->intermediate;
  const int64_t q_size = s->heads * D, kv_size = s->kv_heads * D, qkv_size = q_size + 2 * kv_size;
  float* h = workspace;          // the residual stream [t, H]
  float* normed = h + t * H;     // [t, H]
  float* y = normed + t * H;     // a layer's output, o_proj's or down's [t, H]
  float* qkv = y + t * H;        // [t, q + 2 kv]
  float* q = qkv + t * qkv_size; // the queries, contiguous [t, heads, D]
  float* attn = q + t * q_size;  // [t, heads * D]
  float* gate_up = attn + t * q_size;  // [t, 2 I]
  float* act = gate_up + t * 2 * I;    // [t, I]
  float* scratch = act + t * I;        // the LoRA products' (lora_scratch)

  for (int64_t l = 0; l < s->num_layers; ++l) {
    const TmLayer& L = s->layers[l];
    uint8_t* kc = k_cache + l * layer_bytes;
    uint8_t* vc = v_cache + l * layer_bytes;
    // Residual add (none before the first layer) and the input norm.
    if (l == 0) s->rms_norm(x, H, nullptr, L.input_norm, s->eps, h, normed, t, H);
    else s->rms_norm(y, H, h, L.input_norm, s->eps, h, normed, t, H);
    if (L.qkv.gemm((int)L.qkv.fmt, normed, t, H, L.qkv.weights, qkv_size, qkv, threads)) return -100 - (int)l;
    if (add_lora(s, L.qkv, lora, normed, H, qkv, scratch, threads)) return -100 - (int)l;
    s->rotary(qkv, qkv_size, t, s->heads, D, positions, s->cos_table, s->sin_table);
    s->rotary(qkv + q_size, qkv_size, t, s->kv_heads, D, positions, s->cos_table, s->sin_table);
    s->store_keys(qkv + q_size, qkv_size, t, s->kv_heads, D, slots, kc, block_size);
    s->store_values(qkv + q_size + kv_size, qkv_size, t, kv_size, slots, vc);
    for (int64_t i = 0; i < t; ++i) memcpy(q + i * q_size, qkv + i * qkv_size, q_size * sizeof(float));
    if (s->attention(q, t, s->heads, s->kv_heads, D, kc, vc, block_size, positions, seq_of_token, tables,
                     table_width, s->scale, attn, threads))
      return -200 - (int)l;
    if (L.o.gemm((int)L.o.fmt, attn, t, q_size, L.o.weights, H, y, threads)) return -100 - (int)l;
    if (add_lora(s, L.o, lora, attn, q_size, y, scratch, threads)) return -100 - (int)l;
    s->rms_norm(y, H, h, L.post_norm, s->eps, h, normed, t, H);
    if (L.gate_up.gemm((int)L.gate_up.fmt, normed, t, H, L.gate_up.weights, 2 * I, gate_up, threads))
      return -100 - (int)l;
    if (add_lora(s, L.gate_up, lora, normed, H, gate_up, scratch, threads)) return -100 - (int)l;
    s->silu_and_mul(gate_up, act, t, I);
    if (L.down.gemm((int)L.down.fmt, act, t, I, L.down.weights, H, y, threads)) return -100 - (int)l;
    if (add_lora(s, L.down, lora, act, I, y, scratch, threads)) return -100 - (int)l;
  }
  s->rms_norm(y, H, h, s->final_norm, s->eps, h, out, t, H);
  return 0;
}
}
