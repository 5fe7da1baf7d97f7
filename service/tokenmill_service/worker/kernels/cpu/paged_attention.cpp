// Causal attention of each new token over its sequence's paged KV cache, float32, on the CPU.
// Written in simd.h's ops and built once per instruction set by worker/kernels/cpu/build.py: every build
// gives the same bits.
//
// Every query is computed on its own, in one fixed order that depends only on its position: the
// scores of keys 0..p (each summed over the head dimension in order), their maximum, the
// exponentials, then the weighted sum of values in key order. So a query's result is bit-for-bit
// the same whatever else is in the batch, and whether it arrives in a prefill chunk or as a decode
// token. What a tile shares is only loads: the query heads that share a key/value head, and up to
// 48 (token, head) rows of a prefill chunk, are scored together against each 64 keys while those
// are in L1, and then take their values the same way; no row's arithmetic depends on the others.
//
// A sliding-window layer's query at p sees keys p - window + 1 .. p only: the keys below its window
// get weight exactly 0 (and the tile starts at the 16 keys holding its rows' first visible key), so
// the extra keys another row brings into a tile add exact zeros. Soft-capping (Gemma 2) turns each
// score s into tanh(s / cap) * cap, elementwise, before the maximum and the exponentials.
// Attention sinks (gpt-oss) add a learned logit per head to each row's softmax: it takes part in the
// row's maximum and adds its exponential to the denominator, and weighs no value (-inf: none).

#include <omp.h>
#include <math.h>
#include <stdint.h>

#include <algorithm>
#include <vector>

#include "simd.h"
#include "tm_abi.h"  // this file's prototypes (generated from abi.py)
#include "attention_tiles.h"  // the tiles: runs of one sequence's tokens

namespace {

using namespace simd;

// The caches hold float32, or float16 (uint16_t bits; --kv-cache-dtype float16): 16 of either as
// float32 lanes. float16 converts exactly to float32, so the arithmetic below is the same for both.
inline f32x16 load16(const float* p) { return load(p); }
inline f32x16 load16(const uint16_t* p) { return load_half(p); }
inline void store_one(float* dst, float x) { *dst = x; }
inline void store_one(uint16_t* dst, float x) { *dst = float_to_half(x); }

// The softmax's weights are simd::exp2_nonpositive of x = score - maximum <= 0: scores are kept in
// base 2 (the queries come scaled by log2(e), so 2^x is the e^x of the natural scores), and x is
// clamped at -125 there so that a weight stays a normal float (denormals slow the products).

// The key cache keeps each block transposed, [kv_heads][head_dim][block_size]: the scores of 16
// keys are then 16 lanes of one multiply-add per dimension, with no horizontal sums.
template <typename T>
inline const T* key_block(const T* k_cache, int64_t block, int64_t kv_heads, int64_t kvh, int64_t d,
                              int64_t block_size) {
  return k_cache + (block * kv_heads + kvh) * d * block_size;
}

constexpr int MAX_ROWS = 48;  // query rows (token x head) of a tile
// Rows scored together against SC columns of 16 keys: SR x SC accumulators and the SC columns in the
// vector registers (AVX-512's 32: 6 x 4 + 4; the 8 of AVX2 and NEON: 6 x 1 + 1, which measured on AVX2
// faster than 2 x 2 + 2 and than AVX-512's tile spilled). Only loads are shared: no score depends on them.
constexpr int SR = 6;
constexpr int SC = VECTOR_REGISTERS >= 32 ? 4 : 1;
// Columns of 16 keys per pass over the keys, SC at a time: the next pass's keys are prefetched a pass
// ahead (on AVX2, passes of 16 keys measured 3-5% slower decoding than 64).
constexpr int PASS_COLUMNS = 4;
static_assert(PASS_COLUMNS % SC == 0, "whole groups of columns");

// The rows of one tile: up to MAX_ROWS (token, head) pairs of one sequence and one key/value head.
struct Rows {
  int count = 0;
  const float* q[MAX_ROWS];
  float* out[MAX_ROWS];
  int64_t keys[MAX_ROWS];   // the keys each row sees end before this: its position + 1
  int64_t first[MAX_ROWS];  // ... and start here: 0, or its window's first key
  float sink[MAX_ROWS];     // the row's head's sink logit in base 2 (-inf: none)
};

constexpr float LOG2E = 1.44269504088896341f;

// Lanes of the 16 keys from j that lie in [lo, hi).
inline lanes live_keys(int64_t j, int64_t lo, int64_t hi) {
  return (lanes)(first_lanes(hi - j) & ~first_lanes(lo - j));
}

// Asks for `count` runs of `bytes` at `stride` elements from p to be brought into L2. A block table scatters
// a sequence's keys and values over the pool, so the hardware prefetchers lose the stream at every block;
// the passes below ask for their next keys and values one pass ahead. One decoding token over 4000 keys of
// 16 layers (bench/kernels/attention_speed.py, an AMD EPYC, 2 threads) read them at 14.3 GB/s without,
// 18.5 with (float16: 10.2 and 16.4); two passes ahead measured alike, into L1 (prefetcht0) as without.
template <typename T>
inline void prefetch_runs(const T* p, int64_t count, int64_t stride, int64_t bytes) {
  for (int64_t i = 0; i < count; ++i) {
    const char* run = (const char*)(p + i * stride);
    for (int64_t b = 0; b < bytes; b += 64) prefetch_l2(run + b);
  }
}

// Keys [j, j + 16) of one key/value head as [D][16] columns: a pointer into the cache when they
// lie in one block (stride block_size), else gathered into buf (stride 16; keys past n are 0).
template <typename T>
inline const T* key_columns(const T* k_cache, const int64_t* table, int64_t j, int64_t n, int64_t kv_heads,
                            int64_t kvh, int64_t D, int64_t block_size, T* buf, int64_t& stride) {
  const int64_t block = j / block_size, slot = j % block_size;
  if (slot + 16 <= block_size) {
    stride = block_size;
    return key_block(k_cache, table[block], kv_heads, kvh, D, block_size) + slot;
  }
  for (int64_t c = 0; c < 16; ++c) {
    const int64_t jj = j + c;
    const T* col = jj < n ? key_block(k_cache, table[jj / block_size], kv_heads, kvh, D, block_size) + jj % block_size
                              : nullptr;
    for (int64_t d = 0; d < D; ++d) buf[d * 16 + c] = col ? col[d * block_size] : T(0);
  }
  stride = 16;
  return buf;
}

// Scores of R rows (packed q, [R][D], already scaled) against C columns of 16 keys: each score is
// the sum over d of q[d] * k[d] in d order, one multiply-add chain per score, whatever R is. Each row's running
// maximum over its own keys (j < keys[r]) is kept in mx.
template <int R, int C, int64_t D, typename T>
inline void score_rows(const float* qp, const int64_t* keys, const int64_t* first, const T* const* col,
                       const int64_t* stride, float* scores, int64_t ld, int64_t j, f32x16* mx) {
  f32x16 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = zero_f();
  for (int64_t d = 0; d < D; ++d) {
    f32x16 k[C];
    for (int c = 0; c < C; ++c) k[c] = load16(col[c] + d * stride[c]);
    for (int r = 0; r < R; ++r) {
      const f32x16 qd = set1(qp[r * D + d]);
      for (int c = 0; c < C; ++c) acc[r][c] = fmadd(qd, k[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float* s = scores + r * ld + j;
    for (int c = 0; c < C; ++c) {
      const f32x16 x = acc[r][c];
      store(s + 16 * c, x);
      const lanes live = live_keys(j + 16 * c, first[r], keys[r]);
      if (live == 0xFFFF) mx[r] = max(mx[r], x);
      else if (live) mx[r] = select(live, max(mx[r], x), mx[r]);
    }
  }
}

template <int R, int C, int64_t D, typename T>
struct ScoreDispatch {
  static void run(int count, const float* qp, const int64_t* keys, const int64_t* first, const T* const* col,
                  const int64_t* stride, float* scores, int64_t ld, int64_t j, f32x16* mx) {
    if (count == R) score_rows<R, C, D>(qp, keys, first, col, stride, scores, ld, j, mx);
    else ScoreDispatch<R - 1, C, D, T>::run(count, qp, keys, first, col, stride, scores, ld, j, mx);
  }
};
template <int C, int64_t D, typename T>
struct ScoreDispatch<0, C, D, T> {
  static void run(int, const float*, const int64_t*, const int64_t*, const T* const*, const int64_t*, float*,
                  int64_t, int64_t, f32x16*) {}
};

// Scores of all rows against the next `cols` (1..C) columns, SR rows at a time.
template <int C, int64_t D, typename T>
inline void score_all(int cols, const Rows& rows, const float* qp, const T* const* col, const int64_t* stride,
                      float* scores, int64_t ld, int64_t j, f32x16* mx) {
  if constexpr (C > 1)
    if (cols < C) return score_all<C - 1, D>(cols, rows, qp, col, stride, scores, ld, j, mx);
  for (int r0 = 0; r0 < rows.count; r0 += SR)
    ScoreDispatch<SR, C, D, T>::run(std::min(SR, rows.count - r0), qp + r0 * D, rows.keys + r0, rows.first + r0,
                                    col, stride, scores + r0 * ld, ld, j, mx + r0);
}

// Adds keys [j0, j1) of R rows' softmax(scores) times the values to their sums acc (row r's VD vectors
// at acc_mem + r * acc_ld: a slice of its head dimension, VD of its values' 16 lanes from v_cache), the
// loads of v shared: each row adds its own keys (j < keys[r]) in key order. Keys below every row's
// count need no test.
template <int VD, int R, typename T>
inline void value_rows(f32x16* acc_mem, int64_t acc_ld, const int64_t* keys, const float* pr, int64_t ld,
                       const T* v_cache, const int64_t* table, int64_t block_size, int64_t head_stride, int64_t j0,
                       int64_t j1) {
  f32x16 acc[R][VD];
  for (int r = 0; r < R; ++r)
    for (int d = 0; d < VD; ++d) acc[r][d] = acc_mem[r * acc_ld + d];
  int64_t lo = keys[0];
  for (int r = 1; r < R; ++r) lo = std::min(lo, keys[r]);
  const int64_t jm = std::min(j1, std::max(j0, lo));
  for (int64_t j = j0; j < j1;) {
    const int64_t block = j / block_size;
    const T* vb = v_cache + (table[block] * block_size - block * block_size) * head_stride;
    const int64_t end = std::min(j1, (block + 1) * block_size);
    for (const int64_t e = std::min(end, jm); j < e; ++j) {
      const T* vj = vb + j * head_stride;
      f32x16 v[VD];
      for (int d = 0; d < VD; ++d) v[d] = load16(vj + d * 16);
      for (int r = 0; r < R; ++r) {
        const f32x16 w = set1(pr[r * ld + j]);
        for (int d = 0; d < VD; ++d) acc[r][d] = fmadd(w, v[d], acc[r][d]);
      }
    }
    for (; j < end; ++j) {
      const T* vj = vb + j * head_stride;
      f32x16 v[VD];
      for (int d = 0; d < VD; ++d) v[d] = load16(vj + d * 16);
      for (int r = 0; r < R; ++r) {
        if (j >= keys[r]) continue;  // past the row's own keys
        const f32x16 w = set1(pr[r * ld + j]);
        for (int d = 0; d < VD; ++d) acc[r][d] = fmadd(w, v[d], acc[r][d]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int d = 0; d < VD; ++d) acc_mem[r * acc_ld + d] = acc[r][d];
}

template <int VD, int R, typename T>
struct ValueDispatch {
  static void run(int count, f32x16* acc, int64_t acc_ld, const int64_t* keys, const float* pr, int64_t ld,
                  const T* v_cache, const int64_t* table, int64_t block_size, int64_t head_stride, int64_t j0,
                  int64_t j1) {
    if (count == R) value_rows<VD, R>(acc, acc_ld, keys, pr, ld, v_cache, table, block_size, head_stride, j0, j1);
    else ValueDispatch<VD, R - 1, T>::run(count, acc, acc_ld, keys, pr, ld, v_cache, table, block_size, head_stride,
                                          j0, j1);
  }
};
template <int VD, typename T>
struct ValueDispatch<VD, 0, T> {
  static void run(int, f32x16*, int64_t, const int64_t*, const float*, int64_t, const T*, const int64_t*, int64_t,
                  int64_t, int64_t, int64_t) {}
};

// Attention of a tile's rows (one sequence, one key/value head) over that sequence's cache.
template <int DV, typename T>
void attend(const Rows& rows, const T* k_cache, const T* v_cache, int64_t kv_heads, int64_t kvh,
            const int64_t* table, int64_t block_size, float scale, float softcap, std::vector<float>& scratch,
            std::vector<T>& kbuf) {
  constexpr int64_t D = DV * 16;
  constexpr int64_t W = 16 * PASS_COLUMNS;  // keys scored per pass over the rows
  int64_t n_max = 0, j_first = INT64_MAX;
  for (int r = 0; r < rows.count; ++r) {
    n_max = std::max(n_max, rows.keys[r]);
    j_first = std::min(j_first, rows.first[r]);
  }
  j_first = j_first / 16 * 16;  // whole columns of 16 keys, at the same absolute keys for every tile
  const int64_t ld = (n_max + 15) / 16 * 16;
  scratch.resize(rows.count * ld);
  kbuf.resize(PASS_COLUMNS * D * 16);
  float* scores = scratch.data();
  alignas(64) float qp[MAX_ROWS * D];
  // Scores in base 2, scaled as they are summed; soft-capped ones are capped first (below).
  const float q_scale = softcap > 0.0f ? scale : scale * LOG2E;
  for (int r = 0; r < rows.count; ++r)
    for (int64_t d = 0; d < D; ++d) qp[r * D + d] = rows.q[r][d] * q_scale;
  f32x16 mx[MAX_ROWS];
  for (int r = 0; r < rows.count; ++r) mx[r] = set1(-INFINITY);
  for (int64_t j = j_first; j < n_max; j += W) {
    for (int64_t jn = j + W; jn < std::min(n_max, j + 2 * W); jn += 16)  // the next pass's keys: D rows of 16
      prefetch_runs(key_block(k_cache, table[jn / block_size], kv_heads, kvh, D, block_size) + jn % block_size, D,
                    block_size, 16 * (int64_t)sizeof(T));
    const T* col[PASS_COLUMNS];
    int64_t stride[PASS_COLUMNS];
    for (int c = 0; c < PASS_COLUMNS && j + 16 * c < n_max; ++c)
      col[c] = key_columns(k_cache, table, j + 16 * c, n_max, kv_heads, kvh, D, block_size, kbuf.data() + c * D * 16,
                           stride[c]);
    // The last keys: only the columns holding some.
    const int cols = (int)std::min<int64_t>(PASS_COLUMNS, (n_max - j + 15) / 16);
    for (int c = 0; c < cols; c += SC)
      score_all<SC, D>(std::min(SC, cols - c), rows, qp, col + c, stride + c, scores, ld, j + 16 * c, mx);
  }
  if (softcap > 0.0f) {  // each visible score s -> tanh(s / cap) * cap (in base 2), and the rows' maxima again
    const f32x16 cap = set1(softcap), log2e = set1(LOG2E);
    for (int r = 0; r < rows.count; ++r) {
      float* s = scores + r * ld;
      f32x16 m = set1(-INFINITY);
      for (int64_t j = rows.first[r]; j < rows.keys[r]; j += 16) {
        const lanes live = first_lanes(rows.keys[r] - j);
        const f32x16 x = mul(mul(simd::tanh(div(load_masked(s + j, live), cap)), cap), log2e);
        store_masked(s + j, live, x);
        m = select(live, max(m, x), m);
      }
      mx[r] = m;
    }
  }
  // Softmax and values, a chunk of VW keys at a time so that its scores and values stay in L1: the
  // exponentials of a row's scores (the maximum is exact in any order; the exponentials are
  // elementwise; the denominator is summed in 16 lanes by key index, then reduced: all fixed by
  // the row's own key count), then their sum with the values, in key order.
  // Each pass over the values takes VR rows and a slice of VD vectors of the head dimension: VR x VD
  // accumulators and VD values in the vector registers (32: 6 x 4 + 4; 8: 6 x 1 + 1). A slice, rather
  // than the whole head dimension with fewer rows, loads each value for 6 rows: prefilling 256 tokens
  // over 1024 keys (one thread) measured 1.4x faster on AVX-512 at head_dim 256 (one row a pass
  // before), 1.15x at 128, and on AVX2 1.3-1.5x faster than 3 rows of the whole head dimension;
  // decoding within 5% either way. No sum depends on VR or VD.
  constexpr int VD = std::min(DV, VECTOR_REGISTERS / 8);
  constexpr int VR = 6;
  static_assert(DV % VD == 0, "whole slices of the head dimension");
  constexpr int64_t VW = 64;
  f32x16 mv[MAX_ROWS], sum[MAX_ROWS];
  f32x16 acc[MAX_ROWS * DV];
  for (int r = 0; r < rows.count; ++r) {
    mv[r] = set1(std::max(reduce_max(mx[r]), rows.sink[r]));
    sum[r] = zero_f();
    for (int d = 0; d < DV; ++d) acc[r * DV + d] = zero_f();
  }
  const T* vc = v_cache + kvh * D;
  for (int64_t j0 = j_first; j0 < n_max; j0 += VW) {
    for (int64_t jn = j0 + VW; jn < std::min(n_max, j0 + 2 * VW); ++jn)  // the next chunk's values
      prefetch_runs(vc + (table[jn / block_size] * block_size + jn % block_size) * kv_heads * D, 1, 0,
                    D * (int64_t)sizeof(T));
    for (int r0 = 0; r0 < rows.count; r0 += VR) {
      int64_t hi = 0;
      const int count = std::min(VR, rows.count - r0);
      for (int r = r0; r < r0 + count; ++r) {
        const int64_t n = std::min(rows.keys[r], j0 + VW);
        hi = std::max(hi, rows.keys[r]);
        float* s = scores + r * ld;
        const f32x16 mr = mv[r];
        f32x16 sr = sum[r];  // in a register across the chunk
        for (int64_t j = j0; j < n; j += 16) {
          // Keys below the row's window (and past its last) weigh exactly 0.
          const lanes m = first_lanes(n - j);
          const lanes live = live_keys(j, rows.first[r], n);
          const f32x16 e = select(live, exp2_nonpositive(sub(load_masked(s + j, live), mr)), zero_f());
          store_masked(s + j, m, e);
          sr = add(sr, e);
        }
        sum[r] = sr;
      }
      if (j0 < hi)
        for (int d0 = 0; d0 < DV; d0 += VD)
          ValueDispatch<VD, VR, T>::run(count, acc + r0 * DV + d0, DV, rows.keys + r0, scores + r0 * ld, ld,
                                        vc + d0 * 16, table, block_size, kv_heads * D, j0, std::min(hi, j0 + VW));
    }
  }
  for (int r = 0; r < rows.count; ++r) {
    // A sink's exponential joins the denominator; exactly 0 where there is none (-inf: exp2_nonpositive
    // clamps at 2^-125).
    const float sink = rows.sink[r] == -INFINITY ? 0.0f : exp2_nonpositive_one(rows.sink[r] - lane0(mv[r]));
    const f32x16 scale = set1(1.0f / (reduce_add(sum[r]) + sink));
    for (int d = 0; d < DV; ++d) store(rows.out[r] + d * 16, mul(acc[r * DV + d], scale));
  }
}

template <int DV, typename T>
void run(const float* q, int64_t t, int64_t heads, int64_t kv_heads, const T* k_cache, const T* v_cache,
         int64_t block_size, const int64_t* positions, const int64_t* seq_of_token, const int64_t* tables,
         int64_t table_width, float scale, int64_t window, float softcap, const float* sinks, float* out,
         int threads) {
  constexpr int64_t D = DV * 16;
  const int64_t g = heads / kv_heads;
  // Tiles: runs of up to MAX_ROWS / g consecutive tokens of one sequence (a prefill chunk's rows
  // share the loads of its keys and values); every decode token is a tile of its own.
  const int64_t per_tile = std::max<int64_t>(1, MAX_ROWS / g);
  const std::vector<int64_t> starts = sequence_runs(seq_of_token, t, per_tile);
  const int64_t tiles = (int64_t)starts.size() - 1;
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> scratch;
    std::vector<T> kbuf;
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < tiles * kv_heads; ++item) {
      const int64_t kvh = item / tiles, tile = item % tiles;  // a head's tiles in a row: its keys stay in cache
      const int64_t* table = tables + seq_of_token[starts[tile]] * table_width;
      // Rows in passes of at most MAX_ROWS (a token's heads never split when g <= MAX_ROWS).
      Rows rows;
      auto flush = [&] {
        if (rows.count)
          attend<DV>(rows, k_cache, v_cache, kv_heads, kvh, table, block_size, scale, softcap, scratch, kbuf);
        rows.count = 0;
      };
      for (int64_t i = starts[tile]; i < starts[tile + 1]; ++i)
        for (int64_t h = 0; h < g; ++h) {
          if (rows.count == MAX_ROWS) flush();
          const int64_t row = (i * heads + kvh * g + h) * D;
          rows.q[rows.count] = q + row;
          rows.out[rows.count] = out + row;
          rows.keys[rows.count] = positions[i] + 1;
          rows.first[rows.count] = window > 0 ? std::max<int64_t>(0, positions[i] + 1 - window) : 0;
          rows.sink[rows.count] = sinks ? sinks[kvh * g + h] * LOG2E : -INFINITY;
          ++rows.count;
        }
      flush();
    }
  }
}


template <typename T>
void store_keys(const float* k, int64_t k_stride, int64_t t, int64_t kv_heads, int64_t head_dim, const int64_t* slots,
                T* k_cache, int64_t block_size) {
  for (int64_t i = 0; i < t; ++i) {
    const int64_t block = slots[i] / block_size, offset = slots[i] % block_size;
    for (int64_t kvh = 0; kvh < kv_heads; ++kvh) {
      T* dst = k_cache + (block * kv_heads + kvh) * head_dim * block_size + offset;
      const float* src = k + i * k_stride + kvh * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) store_one(dst + d * block_size, src[d]);
    }
  }
}

template <typename T>
void store_values(const float* v, int64_t v_stride, int64_t t, int64_t row, const int64_t* slots, T* v_cache) {
  for (int64_t i = 0; i < t; ++i)
    for (int64_t c = 0; c < row; ++c) store_one(v_cache + slots[i] * row + c, v[i * v_stride + c]);
}

template <typename T>
int attention(const float* q, int64_t t, int64_t heads, int64_t kv_heads, int64_t head_dim, const T* k_cache,
              const T* v_cache, int64_t block_size, const int64_t* positions, const int64_t* seq_of_token,
              const int64_t* tables, int64_t table_width, float scale, int64_t window, float softcap,
              const float* sinks, float* out, int threads) {
  if (heads % kv_heads) return -2;
  switch (head_dim) {
    case 64:
      run<4>(q, t, heads, kv_heads, k_cache, v_cache, block_size, positions, seq_of_token, tables, table_width, scale,
             window, softcap, sinks, out, threads);
      return 0;
    case 128:
      run<8>(q, t, heads, kv_heads, k_cache, v_cache, block_size, positions, seq_of_token, tables, table_width, scale,
             window, softcap, sinks, out, threads);
      return 0;
    case 256:  // Gemma 2 and 3
      run<16>(q, t, heads, kv_heads, k_cache, v_cache, block_size, positions, seq_of_token, tables, table_width,
              scale, window, softcap, sinks, out, threads);
      return 0;
    default:
      return -1;
  }
}

}  // namespace

extern "C" {

// Writes this step's keys k [t, kv_heads, head_dim] (row stride k_stride) into their slots of the
// transposed key cache: slot = block * block_size + offset. _f16: a float16 cache (rounded to nearest).
void tm_store_keys(const float* k, int64_t k_stride, int64_t t, int64_t kv_heads, int64_t head_dim,
                   const int64_t* slots, float* k_cache, int64_t block_size) {
  store_keys(k, k_stride, t, kv_heads, head_dim, slots, k_cache, block_size);
}
void tm_store_keys_f16(const float* k, int64_t k_stride, int64_t t, int64_t kv_heads, int64_t head_dim,
                       const int64_t* slots, uint16_t* k_cache, int64_t block_size) {
  store_keys(k, k_stride, t, kv_heads, head_dim, slots, k_cache, block_size);
}

// Writes this step's values, rows of `row` = kv_heads * head_dim floats (row stride v_stride), into
// their slots of the value cache [slots][row].
void tm_store_values(const float* v, int64_t v_stride, int64_t t, int64_t row, const int64_t* slots, float* v_cache) {
  store_values(v, v_stride, t, row, slots, v_cache);
}
void tm_store_values_f16(const float* v, int64_t v_stride, int64_t t, int64_t row, const int64_t* slots,
                         uint16_t* v_cache) {
  store_values(v, v_stride, t, row, slots, v_cache);
}

// q, out: [t, heads, head_dim]; caches: [blocks, block_size, kv_heads, head_dim]; tables:
// [sequences, table_width] block ids; token i is at positions[i] of sequence seq_of_token[i].
// Returns 0, or -1 when head_dim is not 64, 128 or 256, -2 when heads is not a multiple of kv_heads.
// _f16: float16 caches (each key and value converted to float32 as read; the same arithmetic).
int tm_paged_attention(const float* q, int64_t t, int64_t heads, int64_t kv_heads, int64_t head_dim,
                       const float* k_cache, const float* v_cache, int64_t block_size, const int64_t* positions,
                       const int64_t* seq_of_token, const int64_t* tables, int64_t table_width, float scale,
                       float* out, int threads) {
  return attention(q, t, heads, kv_heads, head_dim, k_cache, v_cache, block_size, positions, seq_of_token, tables,
                   table_width, scale, 0, 0.0f, nullptr, out, threads);
}
int tm_paged_attention_f16(const float* q, int64_t t, int64_t heads, int64_t kv_heads, int64_t head_dim,
                           const uint16_t* k_cache, const uint16_t* v_cache, int64_t block_size,
                           const int64_t* positions, const int64_t* seq_of_token, const int64_t* tables,
                           int64_t table_width, float scale, float* out, int threads) {
  return attention(q, t, heads, kv_heads, head_dim, k_cache, v_cache, block_size, positions, seq_of_token, tables,
                   table_width, scale, 0, 0.0f, nullptr, out, threads);
}

// As tm_paged_attention, for a sliding-window layer (window > 0: token i sees keys positions[i] -
// window + 1 .. positions[i]) and/or with soft-capped scores (softcap > 0; 0: none) and/or attention
// sinks (sinks: [heads] logits, each in its head's softmax denominator; null: none).
int tm_paged_attention_window(const float* q, int64_t t, int64_t heads, int64_t kv_heads, int64_t head_dim,
                              const float* k_cache, const float* v_cache, int64_t block_size,
                              const int64_t* positions, const int64_t* seq_of_token, const int64_t* tables,
                              int64_t table_width, float scale, int64_t window, float softcap, const float* sinks,
                              float* out, int threads) {
  return attention(q, t, heads, kv_heads, head_dim, k_cache, v_cache, block_size, positions, seq_of_token, tables,
                   table_width, scale, window, softcap, sinks, out, threads);
}
int tm_paged_attention_window_f16(const float* q, int64_t t, int64_t heads, int64_t kv_heads, int64_t head_dim,
                                  const uint16_t* k_cache, const uint16_t* v_cache, int64_t block_size,
                                  const int64_t* positions, const int64_t* seq_of_token, const int64_t* tables,
                                  int64_t table_width, float scale, int64_t window, float softcap,
                                  const float* sinks, float* out, int threads) {
  return attention(q, t, heads, kv_heads, head_dim, k_cache, v_cache, block_size, positions, seq_of_token, tables,
                   table_width, scale, window, softcap, sinks, out, threads);
}
}
