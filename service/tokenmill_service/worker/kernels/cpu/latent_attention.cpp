// Multi-head latent attention (DeepSeek-V2/V3's MLA) in the absorbed form over the paged latent
// cache, float32, on the CPU, in simd.h's ops (the same bits on every instruction set). Built and loaded
// by kernels/cpu/build.py.
//
// A token caches one latent c [L] and one rotary key k_rope [R], shared by every head. A query row
// (token i, head h) at position p, as worker/kernels/latent_attention.py computes it in torch:
//
//   q_lat   = q_nope @ w_uk[h]                                  [L]  (the key up-projection, absorbed)
//   s_j     = (q_lat . c_j + q_rope . k_rope_j) * scale         j = 0 .. p of its sequence
//   o       = sum_j softmax(s)_j c_j                            [L]  (attention in latent space)
//   out     = o @ w_uv[h]                                       [V]  (the value up-projection)
//
// Every row is computed on its own, in one fixed order that depends only on its position: q_lat
// summed over the nope dims in order; each score one multiply-add chain of 16 lanes over the latent
// then the rotary dims, its lanes then summed by one fixed reduction; the maximum; the
// exponentials and their sum (16 lanes over the keys in order, then the same reduction); the
// weighted latents summed in key order; out summed over the latent dims in order. So a row's
// result is bit-for-bit the same whatever else is in the batch and whether it arrives in a
// prefill chunk or as a decode token. What a tile shares is only loads: up to MAX_ROWS (token,
// head) rows of one sequence are scored against each key, and take its latent, together; a key a
// row does not see is masked out of its maximum and its sums (never added, not even as a zero), and
// no row's arithmetic depends on the others.

#include <math.h>
#include <omp.h>
#include <stdint.h>

#include <algorithm>
#include <vector>

#include "tm_abi.h"  // this file's prototypes (generated from abi.py)
#include "attention_tiles.h"  // the tiles: runs of one sequence's tokens
#include "simd.h"

namespace {

using namespace simd;

// The caches hold float32, or float16 (uint16_t bits; --kv-cache-dtype float16), converted exactly.
inline f32x16 load16(const float* p) { return load(p); }
inline f32x16 load16(const uint16_t* p) { return load_half(p); }

constexpr int MAX_ROWS = 32;   // (token, head) rows of a tile
constexpr int HEAD_CHUNK = 8;  // heads of a token in one tile (a tile of one decode token still splits)
constexpr int SR = 4;          // rows scored together against one key
constexpr int VB = 4;          // vectors of 16 of a row times a matrix kept in registers together
// Vectors of the latent a pass of the weighted latents sums for SR rows (speed only: each sum is its own
// chain). More than the registers hold, measured: fewer passes over the keys' scattered latents beat
// spilling (decode at 4096 keys ~15% faster with 8 than with 4 on AVX-512 and AVX2; with 1, AVX2's
// register-sized tile, ~25% slower still).
constexpr int VBV = 8;

struct Shape {
  int64_t heads, N, L, R, V;
};

// The up-projections, as views of kv_b_proj's weight or copies: w_uk [H, N, L] (L contiguous) and
// w_uv [H, L, V], V contiguous (uv_v == 1) or L contiguous (uv_l == 1: kv_b_proj's rows as stored).
struct Weights {
  const float* w_uk;
  int64_t uk_h, uk_n;
  const float* w_uv;
  int64_t uv_h, uv_l, uv_v;
};

struct Query {
  const float* q_nope;
  int64_t nope_t, nope_h;  // strides of q_nope [T, H, N] (its last dimension contiguous)
  const float* q_rope;
  int64_t rope_t, rope_h;  // strides of q_rope [T, H, R]
};

// The rows of one tile: (token, head) pairs of one sequence, tokens in order (so keys ascend).
struct Rows {
  int count = 0;
  int64_t token[MAX_ROWS];
  int64_t head[MAX_ROWS];
  int64_t keys[MAX_ROWS];  // the keys the row sees: its position + 1
};

// dst[0 .. n) = sum over k in order of x[k] * w[k * ld + 0 .. n), n a multiple of 16, k from 0.
inline void row_times_matrix(const float* x, int64_t K, const float* w, int64_t ld, int64_t n, float* dst) {
  for (int64_t c0 = 0; c0 < n; c0 += 16 * VB) {
    const int nb = (int)std::min<int64_t>(VB, (n - c0) / 16);
    f32x16 acc[VB];
    for (int c = 0; c < VB; ++c) acc[c] = zero_f();
    for (int64_t k = 0; k < K; ++k) {
      const f32x16 b = set1(x[k]);
      const float* wk = w + k * ld + c0;
      for (int c = 0; c < nb; ++c) acc[c] = fmadd(b, load(wk + 16 * c), acc[c]);
    }
    for (int c = 0; c < nb; ++c) store(dst + c0 + 16 * c, acc[c]);
  }
}

// dst[v] = sum over k in order of x[k] * w[v * ld + k] for v in [0, n): each a chain of 16 lanes over
// k (K a multiple of 16), its lanes then summed by one fixed reduction.
inline void matrix_times_row(const float* x, int64_t K, const float* w, int64_t ld, int64_t n, float* dst) {
  for (int64_t v = 0; v < n; ++v) {
    const float* wv = w + v * ld;
    f32x16 acc = zero_f();
    for (int64_t k = 0; k < K; k += 16) acc = fmadd(load(x + k), load(wv + k), acc);
    dst[v] = reduce_add(acc);
  }
}

// Scores of NR packed query rows (qp, [NR][K], K = L + R) against key j (its latent lat, rotary key rope).
template <int NR, typename T>
inline void score_key(const float* qp, int64_t K, int64_t L, int64_t R, const T* lat, const T* rope, float scale,
                      float* s, int64_t ld) {
  f32x16 acc[NR];
  for (int r = 0; r < NR; ++r) acc[r] = zero_f();
  for (int64_t d = 0; d < L; d += 16) {
    const f32x16 k = load16(lat + d);
    for (int r = 0; r < NR; ++r) acc[r] = fmadd(load(qp + r * K + d), k, acc[r]);
  }
  for (int64_t d = 0; d < R; d += 16) {
    const f32x16 k = load16(rope + d);
    for (int r = 0; r < NR; ++r) acc[r] = fmadd(load(qp + r * K + L + d), k, acc[r]);
  }
  for (int r = 0; r < NR; ++r) s[r * ld] = reduce_add(acc[r]) * scale;
}

template <typename T>
inline void score_rows(int count, const float* qp, int64_t K, int64_t L, int64_t R, const T* lat, const T* rope,
                       float scale, float* s, int64_t ld) {
  switch (count) {
    case 4: score_key<4>(qp, K, L, R, lat, rope, scale, s, ld); break;
    case 3: score_key<3>(qp, K, L, R, lat, rope, scale, s, ld); break;
    case 2: score_key<2>(qp, K, L, R, lat, rope, scale, s, ld); break;
    default: score_key<1>(qp, K, L, R, lat, rope, scale, s, ld); break;
  }
}

// Adds the latents of keys [0, n) weighted by NR rows' probabilities (p, [NR][ld]) to the rows'
// sums acc ([NR][L], vectors c0 .. c0 + nb), each row only its own keys (j < keys[r]), in key order.
template <int NR, typename T>
inline void value_rows(const float* p, int64_t ld, const int64_t* keys, int64_t n, const T* cache,
                       const int64_t* table, int64_t block_size, int64_t L, int64_t c0, int nb, float* acc_mem) {
  f32x16 acc[NR][VBV];
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < VBV; ++c) acc[r][c] = zero_f();
  for (int64_t j = 0; j < n; ++j) {
    const T* lat = cache + (table[j / block_size] * block_size + j % block_size) * L + c0;
    f32x16 v[VBV];
    for (int c = 0; c < nb; ++c) v[c] = load16(lat + 16 * c);
    for (int r = 0; r < NR; ++r) {
      if (j >= keys[r]) continue;  // a key the row does not see: not added, not even as a zero
      const f32x16 w = set1(p[r * ld + j]);
      for (int c = 0; c < nb; ++c) acc[r][c] = fmadd(w, v[c], acc[r][c]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < nb; ++c) store(acc_mem + r * L + c0 + 16 * c, acc[r][c]);
}

template <typename T>
inline void values(int count, const float* p, int64_t ld, const int64_t* keys, int64_t n, const T* cache,
                   const int64_t* table, int64_t block_size, int64_t L, int64_t c0, int nb, float* acc) {
  switch (count) {
    case 4: value_rows<4>(p, ld, keys, n, cache, table, block_size, L, c0, nb, acc); break;
    case 3: value_rows<3>(p, ld, keys, n, cache, table, block_size, L, c0, nb, acc); break;
    case 2: value_rows<2>(p, ld, keys, n, cache, table, block_size, L, c0, nb, acc); break;
    default: value_rows<1>(p, ld, keys, n, cache, table, block_size, L, c0, nb, acc); break;
  }
}

struct Scratch {
  std::vector<float> q;       // [rows][L + R]: each row's absorbed query, then its rotary query
  std::vector<float> scores;  // [rows][ld]: scores, then probabilities (unnormalized)
  std::vector<float> lat;     // [rows][L]: each row's weighted latents
};

template <typename T>
void attend(const Rows& rows, const Query& q, const Shape& sh, const Weights& w,
            const T* latent_cache, const T* rope_cache, const int64_t* table, int64_t block_size, float scale,
            Scratch& sc, float* out) {
  const int64_t L = sh.L, R = sh.R, K = L + R;
  int64_t n = 0;
  for (int r = 0; r < rows.count; ++r) n = std::max(n, rows.keys[r]);
  const int64_t ld = (n + 15) / 16 * 16;
  sc.q.resize(rows.count * K);
  sc.scores.resize(rows.count * ld);
  sc.lat.resize(rows.count * L);
  // The queries: q_nope absorbed through w_uk[h] (summed over the nope dims in order), then q_rope.
  for (int r = 0; r < rows.count; ++r) {
    const float* nope = q.q_nope + rows.token[r] * q.nope_t + rows.head[r] * q.nope_h;
    row_times_matrix(nope, sh.N, w.w_uk + rows.head[r] * w.uk_h, w.uk_n, L, sc.q.data() + r * K);
    const float* rope = q.q_rope + rows.token[r] * q.rope_t + rows.head[r] * q.rope_h;
    std::copy(rope, rope + R, sc.q.data() + r * K + L);
  }
  // Scores of every key of the tile against every row (a row's scores past its own keys are dropped below).
  for (int64_t j = 0; j < n; ++j) {
    const int64_t slot = table[j / block_size] * block_size + j % block_size;
    const T* lat = latent_cache + slot * L;
    const T* rope = rope_cache + slot * R;
    for (int r0 = 0; r0 < rows.count; r0 += SR)
      score_rows(std::min(SR, rows.count - r0), sc.q.data() + r0 * K, K, L, R, lat, rope, scale,
                 sc.scores.data() + r0 * ld + j, ld);
  }
  // Softmax numerators in place (keys past a row's own are 0) and their sums, 16 keys at a time.
  std::vector<float> inv(rows.count);
  for (int r = 0; r < rows.count; ++r) {
    float* s = sc.scores.data() + r * ld;
    const int64_t keys = rows.keys[r];
    float m = -INFINITY;
    for (int64_t j = 0; j < keys; ++j) m = std::max(m, s[j]);
    const f32x16 mv = set1(m);
    f32x16 sum = zero_f();
    for (int64_t j = 0; j < ld; j += 16) {
      const lanes live = first_lanes(keys - j);
      const f32x16 e = select(live, exp(sub(load_masked(s + j, live), mv)), zero_f());
      store(s + j, e);
      sum = add(sum, e);
    }
    inv[r] = 1.0f / reduce_add(sum);
  }
  // The weighted latents, VBV vectors of the latent and SR rows at a time, then normalized.
  for (int64_t c0 = 0; c0 < L; c0 += 16 * VBV) {
    const int nb = (int)std::min<int64_t>(VBV, (L - c0) / 16);
    for (int r0 = 0; r0 < rows.count; r0 += SR) {
      const int cnt = std::min(SR, rows.count - r0);
      int64_t rn = 0;
      for (int r = r0; r < r0 + cnt; ++r) rn = std::max(rn, rows.keys[r]);
      values(cnt, sc.scores.data() + r0 * ld, ld, rows.keys + r0, rn, latent_cache, table, block_size, L, c0, nb,
             sc.lat.data() + r0 * L);
    }
  }
  // Normalized, then through w_uv[h] (summed over the latent dims in order).
  for (int r = 0; r < rows.count; ++r) {
    float* o = sc.lat.data() + r * L;
    const f32x16 scale_v = set1(inv[r]);
    for (int64_t d = 0; d < L; d += 16) store(o + d, mul(load(o + d), scale_v));
    const float* w_uv = w.w_uv + rows.head[r] * w.uv_h;
    float* dst = out + (rows.token[r] * sh.heads + rows.head[r]) * sh.V;
    if (w.uv_v == 1) row_times_matrix(o, L, w_uv, w.uv_l, sh.V, dst);
    else matrix_times_row(o, L, w_uv, w.uv_v, sh.V, dst);
  }
}

template <typename T>
int run(const Query& q, int64_t t, const Shape& sh, const Weights& w, const T* latent_cache,
        const T* rope_cache, int64_t block_size, const int64_t* positions, const int64_t* seq_of_token,
        const int64_t* tables, int64_t table_width, float scale, float* out, int threads) {
  if (sh.L % 16 || sh.R % 16 || sh.V % 16 || sh.L <= 0 || sh.N <= 0) return -1;
  if (w.uv_v != 1 && w.uv_l != 1) return -2;
  const int64_t chunk = std::min<int64_t>(sh.heads, HEAD_CHUNK);
  const int64_t chunks = (sh.heads + chunk - 1) / chunk;
  // Tiles: runs of up to MAX_ROWS / chunk consecutive tokens of one sequence, times the head chunks.
  const int64_t per_tile = std::max<int64_t>(1, MAX_ROWS / chunk);
  const std::vector<int64_t> starts = sequence_runs(seq_of_token, t, per_tile);
  const int64_t tiles = (int64_t)starts.size() - 1;
#pragma omp parallel num_threads(threads)
  {
    Scratch sc;
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < tiles * chunks; ++item) {
      const int64_t tile = item / chunks, h0 = (item % chunks) * chunk;
      const int64_t h1 = std::min(sh.heads, h0 + chunk);
      const int64_t* table = tables + seq_of_token[starts[tile]] * table_width;
      Rows rows;
      for (int64_t i = starts[tile]; i < starts[tile + 1]; ++i)
        for (int64_t h = h0; h < h1; ++h) {
          rows.token[rows.count] = i;
          rows.head[rows.count] = h;
          rows.keys[rows.count] = positions[i] + 1;
          ++rows.count;
        }
      attend(rows, q, sh, w, latent_cache, rope_cache, table, block_size, scale, sc, out);
    }
  }
  return 0;
}

}  // namespace

extern "C" {

// q_nope [t, heads, nope] (strides nope_t, nope_h), q_rope [t, heads, rope] (rope_t, rope_h), their
// last dimensions contiguous; w_uk [heads, nope, latent] (strides uk_h, uk_n, 1), w_uv [heads,
// latent, v] (strides uv_h, uv_l, uv_v; uv_v or uv_l 1); the caches [blocks, block_size, latent] and
// [blocks, block_size, rope]; tables: [sequences, table_width] block ids; token i is at positions[i]
// of sequence seq_of_token[i]; out [t, heads, v]. Returns 0, -1 when latent, rope or v is not a
// multiple of 16, -2 when neither of w_uv's last two dimensions is contiguous. _f16: float16 caches
// (read exactly).
#define TM_LATENT_ATTENTION(SUFFIX, CACHE)                                                                            \
  int tm_latent_attention##SUFFIX(                                                                                    \
      const float* q_nope, int64_t nope_t, int64_t nope_h, const float* q_rope, int64_t rope_t, int64_t rope_h,      \
      int64_t t, int64_t heads, int64_t nope, int64_t latent, int64_t rope, int64_t v, const float* w_uk,            \
      int64_t uk_h, int64_t uk_n, const float* w_uv, int64_t uv_h, int64_t uv_l, int64_t uv_v,                       \
      const CACHE* latent_cache, const CACHE* rope_cache, int64_t block_size, const int64_t* positions,              \
      const int64_t* seq_of_token, const int64_t* tables, int64_t table_width, float scale, float* out,              \
      int threads) {                                                                                                  \
    return run(Query{q_nope, nope_t, nope_h, q_rope, rope_t, rope_h}, t, Shape{heads, nope, latent, rope, v},        \
               Weights{w_uk, uk_h, uk_n, w_uv, uv_h, uv_l, uv_v}, latent_cache, rope_cache, block_size, positions,   \
               seq_of_token, tables, table_width, scale, out, threads);                                              \
  }
TM_LATENT_ATTENTION(, float)
TM_LATENT_ATTENTION(_f16, uint16_t)
}
