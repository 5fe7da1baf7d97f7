// Causal attention of each new token over its sequence's paged KV cache, float32, on the CPU.
// Built and loaded by native/build.py (g++ -O3 -march=native -fopenmp).
//
// Every query is computed on its own, in one fixed order that depends only on its position: the
// scores of keys 0..p (each summed over the head dimension in order), their maximum, the
// exponentials, then the weighted sum of values in key order. So a query's result is bit-for-bit the same whatever else is in the batch,
// and whether it arrives in a prefill chunk or as a decode token. The query heads that share a
// key/value head are done together, so that each cached key and value is read once for them.

#include <immintrin.h>
#include <omp.h>
#include <math.h>
#include <stdint.h>

#include "vec_math.h"

#include <algorithm>
#include <vector>

#if !defined(__AVX512F__)
#error "paged_attention needs AVX-512F"
#endif

namespace {

// The caches hold float32, or float16 (uint16_t bits; --kv-cache-dtype float16): 16 of either as
// float32 lanes. float16 converts exactly to float32, so the arithmetic below is the same for both.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
inline void store_one(float* dst, float x) { *dst = x; }
inline void store_one(uint16_t* dst, float x) { *dst = _cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }

// The key cache keeps each block transposed, [kv_heads][head_dim][block_size]: the scores of 16
// keys are then 16 lanes of one multiply-add per dimension, with no horizontal sums.
template <typename T>
inline const T* key_block(const T* k_cache, int64_t block, int64_t kv_heads, int64_t kvh, int64_t d,
                              int64_t block_size) {
  return k_cache + (block * kv_heads + kvh) * d * block_size;
}

constexpr int MAX_ROWS = 12;  // query rows (token x head) scored together: 24 accumulators

// The rows of one tile: up to MAX_ROWS (token, head) pairs of one sequence and one key/value head.
struct Rows {
  int count = 0;
  const float* q[MAX_ROWS];
  float* out[MAX_ROWS];
  int64_t keys[MAX_ROWS];  // how many keys each row sees: its position + 1
};

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

// Scores of R rows against 32 keys (two columns of 16, k0 and k1): each score is the sum over d
// of q[d] * k[d] in d order, one multiply-add chain per score, whatever R is.
template <int R, typename T>
inline void score_rows(const Rows& rows, int r0, int64_t D, const T* k0, int64_t s0, const T* k1, int64_t s1,
                       float scale, float* scores, int64_t n_max, int64_t j) {
  __m512 a0[R], a1[R];
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    const __m512 c0 = load16(k0 + d * s0), c1 = load16(k1 + d * s1);
    for (int r = 0; r < R; ++r) {
      const __m512 qd = _mm512_set1_ps(rows.q[r0 + r][d]);
      a0[r] = _mm512_fmadd_ps(qd, c0, a0[r]);
      a1[r] = _mm512_fmadd_ps(qd, c1, a1[r]);
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int r = 0; r < R; ++r) {
    float* s = scores + (r0 + r) * (n_max + 32) + j;
    _mm512_storeu_ps(s, _mm512_mul_ps(a0[r], sc));
    _mm512_storeu_ps(s + 16, _mm512_mul_ps(a1[r], sc));
  }
}

template <int R, typename T>
struct ScoreDispatch {
  static void run(int count, const Rows& rows, int r0, int64_t D, const T* k0, int64_t s0, const T* k1,
                  int64_t s1, float scale, float* scores, int64_t n_max, int64_t j) {
    if (count == R) score_rows<R>(rows, r0, D, k0, s0, k1, s1, scale, scores, n_max, j);
    else ScoreDispatch<R - 1, T>::run(count, rows, r0, D, k0, s0, k1, s1, scale, scores, n_max, j);
  }
};
template <typename T>
struct ScoreDispatch<0, T> {
  static void run(int, const Rows&, int, int64_t, const T*, int64_t, const T*, int64_t, float, float*, int64_t,
                  int64_t) {}
};

// Row r's softmax(scores) times the values, for R rows at once (their loads of v shared): each row
// sums its own keys 0..keys[r]-1 in key order; a row past its last key leaves its sums untouched.
template <int DV, int R, typename T>
inline void value_rows(const Rows& rows, int r0, const float* p, int64_t ld, int64_t n_max, const T* v_cache,
                       const int64_t* table, int64_t block_size, int64_t head_stride, const float* inv) {
  __m512 acc[R][DV];
  for (int r = 0; r < R; ++r)
    for (int d = 0; d < DV; ++d) acc[r][d] = _mm512_setzero_ps();
  for (int64_t j0 = 0, b = 0; j0 < n_max; j0 += block_size, ++b) {
    const T* vb = v_cache + table[b] * block_size * head_stride;
    const int64_t end = std::min(block_size, n_max - j0);
    for (int64_t o = 0; o < end; ++o) {
      const int64_t j = j0 + o;
      const T* vj = vb + o * head_stride;
      __m512 v[DV];
      for (int d = 0; d < DV; ++d) v[d] = load16(vj + d * 16);
      for (int r = 0; r < R; ++r) {
        const __mmask16 live = j < rows.keys[r0 + r] ? (__mmask16)0xFFFF : (__mmask16)0;
        const __m512 w = _mm512_set1_ps(p[(r0 + r) * ld + j]);
        for (int d = 0; d < DV; ++d) acc[r][d] = _mm512_mask3_fmadd_ps(w, v[d], acc[r][d], live);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m512 scale = _mm512_set1_ps(inv[r0 + r]);
    for (int d = 0; d < DV; ++d) _mm512_storeu_ps(rows.out[r0 + r] + d * 16, _mm512_mul_ps(acc[r][d], scale));
  }
}

template <int DV, int R, typename T>
struct ValueDispatch {
  static void run(int count, const Rows& rows, int r0, const float* p, int64_t ld, int64_t n_max, const T* v_cache,
                  const int64_t* table, int64_t block_size, int64_t head_stride, const float* inv) {
    if (count == R) value_rows<DV, R>(rows, r0, p, ld, n_max, v_cache, table, block_size, head_stride, inv);
    else ValueDispatch<DV, R - 1, T>::run(count, rows, r0, p, ld, n_max, v_cache, table, block_size, head_stride, inv);
  }
};
template <int DV, typename T>
struct ValueDispatch<DV, 0, T> {
  static void run(int, const Rows&, int, const float*, int64_t, int64_t, const T*, const int64_t*, int64_t,
                  int64_t, const float*) {}
};

// Attention of a tile's rows (one sequence, one key/value head) over that sequence's cache.
template <int DV, typename T>
void attend(const Rows& rows, const T* k_cache, const T* v_cache, int64_t kv_heads, int64_t kvh,
            const int64_t* table, int64_t block_size, float scale, std::vector<float>& scratch, std::vector<T>& kbuf) {
  constexpr int64_t D = DV * 16;
  int64_t n_max = 0;
  for (int r = 0; r < rows.count; ++r) n_max = std::max(n_max, rows.keys[r]);
  const int64_t ld = n_max + 32;
  scratch.resize(rows.count * ld);
  kbuf.resize(2 * D * 16);
  float* scores = scratch.data();
  T* buf0 = kbuf.data();
  T* buf1 = buf0 + D * 16;
  for (int64_t j = 0; j < n_max; j += 32) {
    int64_t s0, s1;
    const T* k0 = key_columns(k_cache, table, j, n_max, kv_heads, kvh, D, block_size, buf0, s0);
    const T* k1 = j + 16 < n_max ? key_columns(k_cache, table, j + 16, n_max, kv_heads, kvh, D, block_size, buf1, s1)
                                 : k0;
    if (j + 16 >= n_max) s1 = s0;  // no second column: score the first twice, ignore the copy
    ScoreDispatch<MAX_ROWS, T>::run(rows.count, rows, 0, D, k0, s0, k1, s1, scale, scores, n_max, j);
  }
  float inv[MAX_ROWS];
  for (int r = 0; r < rows.count; ++r) {
    float* s = scores + r * ld;
    const int64_t n = rows.keys[r];
    // The maximum is exact in any order; the exponentials are elementwise; the denominator is
    // summed in 16 lanes by key index, then reduced: all fixed by n alone.
    __m512 mx16 = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 m = n - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - j)) - 1);
      mx16 = _mm512_mask_max_ps(mx16, m, mx16, _mm512_maskz_loadu_ps(m, s + j));
    }
    const __m512 mv = _mm512_set1_ps(_mm512_reduce_max_ps(mx16));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 m = n - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - j)) - 1);
      const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + j), mv));
      _mm512_mask_storeu_ps(s + j, m, e);
      sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(m, e));
    }
    inv[r] = 1.0f / _mm512_reduce_add_ps(sum);
  }
  constexpr int VR = DV <= 4 ? 6 : 3;  // rows per pass over the values: VR x DV accumulators
  for (int r0 = 0; r0 < rows.count; r0 += VR)
    ValueDispatch<DV, VR, T>::run(std::min(VR, rows.count - r0), rows, r0, scores, ld, n_max, v_cache + kvh * D, table,
                               block_size, kv_heads * D, inv);
}

template <int DV, typename T>
void run(const float* q, int64_t t, int64_t heads, int64_t kv_heads, const T* k_cache, const T* v_cache,
         int64_t block_size, const int64_t* positions, const int64_t* seq_of_token, const int64_t* tables,
         int64_t table_width, float scale, float* out, int threads) {
  constexpr int64_t D = DV * 16;
  const int64_t g = heads / kv_heads;
  // Tiles: runs of up to MAX_ROWS / g consecutive tokens of one sequence (a prefill chunk's rows
  // share the loads of its keys and values); every decode token is a tile of its own.
  const int64_t per_tile = std::max<int64_t>(1, MAX_ROWS / g);
  std::vector<int64_t> starts;
  for (int64_t i = 0; i < t;) {
    starts.push_back(i);
    int64_t e = i + 1;
    while (e < t && e - i < per_tile && seq_of_token[e] == seq_of_token[i]) ++e;
    i = e;
  }
  starts.push_back(t);
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
        if (rows.count) attend<DV>(rows, k_cache, v_cache, kv_heads, kvh, table, block_size, scale, scratch, kbuf);
        rows.count = 0;
      };
      for (int64_t i = starts[tile]; i < starts[tile + 1]; ++i)
        for (int64_t h = 0; h < g; ++h) {
          if (rows.count == MAX_ROWS) flush();
          const int64_t row = (i * heads + kvh * g + h) * D;
          rows.q[rows.count] = q + row;
          rows.out[rows.count] = out + row;
          rows.keys[rows.count] = positions[i] + 1;
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
              const int64_t* tables, int64_t table_width, float scale, float* out, int threads) {
  if (heads % kv_heads) return -2;
  switch (head_dim) {
    case 64:
      run<4>(q, t, heads, kv_heads, k_cache, v_cache, block_size, positions, seq_of_token, tables, table_width, scale,
             out, threads);
      return 0;
    case 128:
      run<8>(q, t, heads, kv_heads, k_cache, v_cache, block_size, positions, seq_of_token, tables, table_width, scale,
             out, threads);
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
// Returns 0, or -1 when head_dim is not 64 or 128, -2 when heads is not a multiple of kv_heads.
// _f16: float16 caches (each key and value converted to float32 as read; the same arithmetic).
int tm_paged_attention(const float* q, int64_t t, int64_t heads, int64_t kv_heads, int64_t head_dim,
                       const float* k_cache, const float* v_cache, int64_t block_size, const int64_t* positions,
                       const int64_t* seq_of_token, const int64_t* tables, int64_t table_width, float scale,
                       float* out, int threads) {
  return attention(q, t, heads, kv_heads, head_dim, k_cache, v_cache, block_size, positions, seq_of_token, tables,
                   table_width, scale, out, threads);
}
int tm_paged_attention_f16(const float* q, int64_t t, int64_t heads, int64_t kv_heads, int64_t head_dim,
                           const uint16_t* k_cache, const uint16_t* v_cache, int64_t block_size,
                           const int64_t* positions, const int64_t* seq_of_token, const int64_t* tables,
                           int64_t table_width, float scale, float* out, int threads) {
  return attention(q, t, heads, kv_heads, head_dim, k_cache, v_cache, block_size, positions, seq_of_token, tables,
                   table_width, scale, out, threads);
}
}
