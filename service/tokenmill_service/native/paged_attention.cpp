// Causal attention of each new token over its sequence's paged KV cache, float32, on the CPU.
// Built and loaded by native/build.py (g++ -O3 -march=native -fopenmp).
//
// Every query is computed on its own, in one fixed order that depends only on its position: the
// scores of keys 0..p one after another, their maximum, the exponentials, then the weighted sum of
// values in key order. So a query's result is bit-for-bit the same whatever else is in the batch,
// and whether it arrives in a prefill chunk or as a decode token. The query heads that share a
// key/value head are done together, so that each cached key and value is read once for them.

#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#include <algorithm>
#include <vector>

#if !defined(__AVX512F__)
#error "paged_attention needs AVX-512F"
#endif

namespace {

// exp(x) for x <= 0 (scores minus their maximum): 2^n * e^r with n = round(x / ln 2) and a
// degree-6 polynomial for e^r, |r| <= ln(2) / 2 (Cephes' expf coefficients, ~1 ulp).
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// One token's G query heads (rows of DV * 16 floats) against keys 0..n-1 of one key/value head.
template <int DV>
void attend(const float* q, int g, int64_t n, const float* k_cache, const float* v_cache, const int64_t* table,
            int64_t block_size, int64_t head_stride, float scale, float* out, int64_t out_stride,
            std::vector<float>& scores) {
  constexpr int D = DV * 16;
  scores.resize(g * n);
  // Scores, head by head per key, in key order.
  for (int64_t j = 0; j < n; ++j) {
    const float* kj = k_cache + (table[j / block_size] * block_size + j % block_size) * head_stride;
    __m512 kv[DV];
    for (int d = 0; d < DV; ++d) kv[d] = _mm512_loadu_ps(kj + d * 16);
    for (int h = 0; h < g; ++h) {
      __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(q + h * D), kv[0]);
      for (int d = 1; d < DV; ++d) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + h * D + d * 16), kv[d], acc);
      scores[h * n + j] = _mm512_reduce_add_ps(acc) * scale;
    }
  }
  for (int h = 0; h < g; ++h) {
    float* s = scores.data() + h * n;
    // The maximum is exact in any order; the exponentials are elementwise; the denominator is
    // summed in 16 lanes by key index, then reduced: all fixed by n alone.
    float m = s[0];
    for (int64_t j = 1; j < n; ++j) m = std::max(m, s[j]);
    const __m512 mv = _mm512_set1_ps(m);
    __m512 sum = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
      const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + j), mv));
      _mm512_storeu_ps(s + j, e);
      sum = _mm512_add_ps(sum, e);
    }
    if (j < n) {
      const __mmask16 tail = (__mmask16)((1u << (n - j)) - 1);
      const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + j), mv));
      _mm512_mask_storeu_ps(s + j, tail, e);
      sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(tail, e));
    }
    const float denominator = _mm512_reduce_add_ps(sum);
    __m512 acc[DV];
    for (int d = 0; d < DV; ++d) acc[d] = _mm512_setzero_ps();
    for (int64_t jj = 0; jj < n; ++jj) {
      const float* vj = v_cache + (table[jj / block_size] * block_size + jj % block_size) * head_stride;
      const __m512 w = _mm512_set1_ps(s[jj]);
      for (int d = 0; d < DV; ++d) acc[d] = _mm512_fmadd_ps(w, _mm512_loadu_ps(vj + d * 16), acc[d]);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / denominator);
    for (int d = 0; d < DV; ++d) _mm512_storeu_ps(out + h * out_stride + d * 16, _mm512_mul_ps(acc[d], inv));
  }
}

template <int DV>
void run(const float* q, int64_t t, int64_t heads, int64_t kv_heads, const float* k_cache, const float* v_cache,
         int64_t block_size, const int64_t* positions, const int64_t* seq_of_token, const int64_t* tables,
         int64_t table_width, float scale, float* out, int threads) {
  constexpr int64_t D = DV * 16;
  const int64_t g = heads / kv_heads;
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> scores;
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < t * kv_heads; ++item) {
      const int64_t i = item / kv_heads, kvh = item % kv_heads;
      const int64_t* table = tables + seq_of_token[i] * table_width;
      // Each key/value head's rows are D floats apart in a cache slot of kv_heads * D.
      attend<DV>(q + (i * heads + kvh * g) * D, (int)g, positions[i] + 1, k_cache + kvh * D, v_cache + kvh * D,
                 table, block_size, kv_heads * D, scale, out + (i * heads + kvh * g) * D, D, scores);
    }
  }
}

}  // namespace

extern "C" {

// q, out: [t, heads, head_dim]; caches: [blocks, block_size, kv_heads, head_dim]; tables:
// [sequences, table_width] block ids; token i is at positions[i] of sequence seq_of_token[i].
// Returns 0, or -1 when head_dim is not 64 or 128, -2 when heads is not a multiple of kv_heads.
int tm_paged_attention(const float* q, int64_t t, int64_t heads, int64_t kv_heads, int64_t head_dim,
                       const float* k_cache, const float* v_cache, int64_t block_size, const int64_t* positions,
                       const int64_t* seq_of_token, const int64_t* tables, int64_t table_width, float scale,
                       float* out, int threads) {
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
}
