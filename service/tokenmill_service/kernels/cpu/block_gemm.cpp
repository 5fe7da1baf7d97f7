// y[M, N] = x[M, K] @ W[N, K]^T for W in GGUF's block formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, MXFP4) kept as stored,
// or plain float32 rows (F32, --quantization none: the same fixed order, nothing to dequantize),
// float32 activations and output. Built and loaded by native.py (g++ -O3 -march=native -fopenmp).
//
// Two promises shape the code:
// - Faithful: each weight is dequantized exactly as gguf does (q * d, + m for Q4_1 and Q5_1, level[q] * d
//   for IQ4_NL and MXFP4; q * d is exact
//   in float32, so the fused multiply-add rounds once, like the multiply-then-add it replaces) and
//   the products are summed in float32.
// - Batch-invariant: every output y[i, n] is reduced in one fixed order (16 float32 lanes over K
//   in steps of 16, then one fixed tree over the lanes, sum4), whatever M is, how the rows are tiled and how
//   the outputs are split between threads. A sequence's result never depends on its batch.
//
// Speed: a tile of weight rows is dequantized once into a small float32 buffer (L1) and reused by
// every activation row; a 6 x 4 register tile of accumulators keeps the FMA units busy.

#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include "tm_abi.h"  // the block formats and this file's prototypes (generated from abi.py)

#if !defined(__AVX512F__) || !defined(__F16C__)
#error "block_gemm needs AVX-512F and F16C"
#endif

namespace {

constexpr int64_t QK = TM_QK;  // weights per block in every format
constexpr int MT = 6;       // activation rows per register tile
constexpr int NT = 4;       // weight rows per register tile

// ggml's type ids.
enum Format : int {
  F32 = TM_FORMAT_F32,
  Q4_0 = TM_FORMAT_Q4_0,
  Q4_1 = TM_FORMAT_Q4_1,
  Q5_0 = TM_FORMAT_Q5_0,
  Q5_1 = TM_FORMAT_Q5_1,
  Q8_0 = TM_FORMAT_Q8_0,
  IQ4_NL = TM_FORMAT_IQ4_NL,
  MXFP4 = TM_FORMAT_MXFP4
};

int64_t block_bytes(int fmt) {
  switch (fmt) {
    case F32: return TM_BLOCK_BYTES_F32;
    case Q4_0: return TM_BLOCK_BYTES_Q4_0;
    case Q4_1: return TM_BLOCK_BYTES_Q4_1;
    case Q5_0: return TM_BLOCK_BYTES_Q5_0;
    case Q5_1: return TM_BLOCK_BYTES_Q5_1;
    case Q8_0: return TM_BLOCK_BYTES_Q8_0;
    case IQ4_NL: return TM_BLOCK_BYTES_IQ4_NL;
    case MXFP4: return TM_BLOCK_BYTES_MXFP4;
    default: return 0;
  }
}

inline __m512 half_at(const uint8_t* p) {
  uint16_t h;
  memcpy(&h, p, 2);
  return _mm512_set1_ps(_cvtsh_ss(h));
}

// One block of 32 weights, dequantized into registers (lo: weights 0..15, hi: 16..31). GGUF's 4-bit
// layout: byte j holds weight j in its low nibble and weight j + 16 in its high nibble.
template <int F>
inline void dequantize_regs(const uint8_t* b, __m512& lo, __m512& hi) {
  if constexpr (F == F32) {
    lo = _mm512_loadu_ps((const float*)b);
    hi = _mm512_loadu_ps((const float*)b + 16);
    return;
  }
  if constexpr (F == MXFP4) {  // E | qs[16]: value[index] * 2^(E - 128), ggml's kvalues_mxfp4 and e8m0 half
    const __m512i table = _mm512_setr_epi32(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    const uint32_t e = b[0], bits = e < 2 ? 0x00200000u << e : (e - 1) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    const __m512 d = _mm512_set1_ps(scale);
    const __m128i v = _mm_loadu_si128((const __m128i*)(b + 1));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m512i il = _mm512_cvtepu8_epi32(_mm_and_si128(v, mask));
    const __m512i ih = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 4), mask));
    lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_permutexvar_epi32(il, table)), d);
    hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_permutexvar_epi32(ih, table)), d);
    return;
  }
  const __m512 d = half_at(b);
  if constexpr (F == Q8_0) {
    lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(b + 2)))), d);
    hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(b + 18)))), d);
  } else if constexpr (F == Q5_0 || F == Q5_1) {  // d | (Q5_1: m) | qh u32 (bit j: weight j's fifth bit) | qs[16]
    const uint8_t* h = b + (F == Q5_1 ? 4 : 2);
    uint32_t qh;
    memcpy(&qh, h, 4);
    const __m128i v = _mm_loadu_si128((const __m128i*)(h + 4));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m512i sixteen = _mm512_set1_epi32(16);
    __m512i ql = _mm512_cvtepu8_epi32(_mm_and_si128(v, mask));
    __m512i qh_ = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 4), mask));
    ql = _mm512_mask_add_epi32(ql, (__mmask16)(qh & 0xFFFF), ql, sixteen);
    qh_ = _mm512_mask_add_epi32(qh_, (__mmask16)(qh >> 16), qh_, sixteen);
    if constexpr (F == Q5_1) {
      const __m512 m = half_at(b + 2);
      lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ql), d, m);
      hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(qh_), d, m);
    } else {  // (q - 16) * d
      lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(ql, sixteen)), d);
      hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(qh_, sixteen)), d);
    }
  } else if constexpr (F == IQ4_NL) {  // d | qs[16]: level[index] * d, ggml's kvalues_iq4nl
    const __m512i table = _mm512_setr_epi32(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113);
    const __m128i v = _mm_loadu_si128((const __m128i*)(b + 2));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m512i il = _mm512_cvtepu8_epi32(_mm_and_si128(v, mask));
    const __m512i ih = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 4), mask));
    lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_permutexvar_epi32(il, table)), d);
    hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_permutexvar_epi32(ih, table)), d);
  } else {
    const uint8_t* qs = b + (F == Q4_1 ? 4 : 2);
    const __m128i v = _mm_loadu_si128((const __m128i*)qs);
    const __m128i mask = _mm_set1_epi8(0x0F);
    __m512i ql = _mm512_cvtepu8_epi32(_mm_and_si128(v, mask));
    __m512i qh = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 4), mask));
    if constexpr (F == Q4_1) {
      const __m512 m = half_at(b + 2);
      lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ql), d, m);
      hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(qh), d, m);
    } else {  // Q4_0: (q - 8) * d
      const __m512i eight = _mm512_set1_epi32(8);
      lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(ql, eight)), d);
      hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(qh, eight)), d);
    }
  }
}

template <int F>
inline void dequantize_block(const uint8_t* b, float* out) {
  __m512 lo, hi;
  dequantize_regs<F>(b, lo, hi);
  _mm512_storeu_ps(out, lo);
  _mm512_storeu_ps(out + 16, hi);
}

// The sums of four accumulators' 16 lanes, all in one fixed tree (whichever slot an accumulator is
// in): x_i = (l_i + l_{i+8}) + (l_{i+4} + l_{i+12}) for i < 4, then (x_0 + x_2) + (x_1 + x_3).
// One pass for four outputs instead of four horizontal sums.
inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(c, d, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 s = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 p = _mm512_add_ps(s, _mm512_permute_ps(s, _MM_SHUFFLE(1, 0, 3, 2)));
  const __m512 q = _mm512_add_ps(p, _mm512_permute_ps(p, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), q));
}

// Writes the sums of acc[0..n) (n <= 4) to y[0..n).
inline void store_sums(const __m512* acc, int n, float* y) {
  const __m512 z = _mm512_setzero_ps();
  const __m128 s = sum4(acc[0], n > 1 ? acc[1] : z, n > 2 ? acc[2] : z, n > 3 ? acc[3] : z);
  _mm_mask_storeu_ps(y, (__mmask8)((1u << n) - 1), s);
}

template <int F>
void dequantize_rows(const uint8_t* w, int64_t rows, int64_t k, float* out) {
  const int64_t blocks = k / QK, bytes = block_bytes(F);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < blocks; ++b) dequantize_block<F>(w + (r * blocks + b) * bytes, out + r * k + b * QK);
}

// y[i, j] for the m x n tile at x (rows of k, stride k) and w (n dequantized rows of k).
template <int M, int N>
inline void tile(const float* x, const float* w, int64_t k, float* y, int64_t ldy) {
  __m512 acc[M][N];
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < N; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t c = 0; c < k; c += 16) {
    __m512 xv[M];
    for (int i = 0; i < M; ++i) xv[i] = _mm512_loadu_ps(x + i * k + c);
    for (int j = 0; j < N; ++j) {
      const __m512 wv = _mm512_loadu_ps(w + j * k + c);
      for (int i = 0; i < M; ++i) acc[i][j] = _mm512_fmadd_ps(wv, xv[i], acc[i][j]);
    }
  }
  for (int i = 0; i < M; ++i) store_sums(acc[i], N, y + i * ldy);
}

template <int M>
inline void tile_rows(int n, const float* x, const float* w, int64_t k, float* y, int64_t ldy) {
  switch (n) {
    case 4: tile<M, 4>(x, w, k, y, ldy); break;
    case 3: tile<M, 3>(x, w, k, y, ldy); break;
    case 2: tile<M, 2>(x, w, k, y, ldy); break;
    default: tile<M, 1>(x, w, k, y, ldy); break;
  }
}

inline void tile_any(int m, int n, const float* x, const float* w, int64_t k, float* y, int64_t ldy) {
  switch (m) {
    case 6: tile_rows<6>(n, x, w, k, y, ldy); break;
    case 5: tile_rows<5>(n, x, w, k, y, ldy); break;
    case 4: tile_rows<4>(n, x, w, k, y, ldy); break;
    case 3: tile_rows<3>(n, x, w, k, y, ldy); break;
    case 2: tile_rows<2>(n, x, w, k, y, ldy); break;
    default: tile_rows<1>(n, x, w, k, y, ldy); break;
  }
}

// Few rows (decode of a few sequences): each block is dequantized into registers and used at once,
// with no buffer. The accumulators see the same multiply-adds in the same order as in tile(), so
// a row's result is the same whichever path its batch takes.
template <int F, int M>
void few_rows(const float* x, int64_t k, const uint8_t* w, int64_t n0, int64_t n1, float* y, int64_t ldy) {
  const int64_t blocks = k / QK, bytes = block_bytes(F), row_bytes = blocks * bytes;
  // F32 rows are 4 bytes a weight and the product waits on memory: one weight row at a time, so
  // that each thread reads one sequential stream (1.4-1.75x faster from DRAM than 4 interleaved
  // rows, measured at 1-4 rows on an AMD EPYC). The quantized formats wait on their arithmetic and
  // keep 4. Each output's sum is the same either way (store_sums' tree does not depend on its slot).
  constexpr int64_t step = F == F32 ? 1 : NT;
  for (int64_t r0 = n0; r0 < n1; r0 += step) {
    const int cols = (int)std::min<int64_t>(step, n1 - r0);
    __m512 acc[M][NT];
    for (int i = 0; i < M; ++i)
      for (int j = 0; j < NT; ++j) acc[i][j] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      __m512 xl[M], xh[M];
      for (int i = 0; i < M; ++i) {
        xl[i] = _mm512_loadu_ps(x + i * k + b * QK);
        xh[i] = _mm512_loadu_ps(x + i * k + b * QK + 16);
      }
      for (int j = 0; j < NT; ++j) {
        if (j >= cols) break;
        __m512 wl, wh;
        dequantize_regs<F>(w + (r0 + j) * row_bytes + b * bytes, wl, wh);
        for (int i = 0; i < M; ++i) {
          acc[i][j] = _mm512_fmadd_ps(wl, xl[i], acc[i][j]);
          acc[i][j] = _mm512_fmadd_ps(wh, xh[i], acc[i][j]);
        }
      }
    }
    for (int i = 0; i < M; ++i) store_sums(acc[i], cols, y + i * ldy + r0);
  }
}

template <int F>
void gemm(const float* x, int64_t m, int64_t k, const uint8_t* w, int64_t n, float* y, int threads) {
  if (m <= 4) {
#pragma omp parallel num_threads(threads)
    {
      const int t = omp_get_thread_num(), nt = omp_get_num_threads();
      const int64_t tiles = (n + NT - 1) / NT;
      const int64_t n0 = tiles * t / nt * NT, n1 = std::min(n, tiles * (t + 1) / nt * NT);
      switch (m) {
        case 1: few_rows<F, 1>(x, k, w, n0, n1, y, n); break;
        case 2: few_rows<F, 2>(x, k, w, n0, n1, y, n); break;
        case 3: few_rows<F, 3>(x, k, w, n0, n1, y, n); break;
        default: few_rows<F, 4>(x, k, w, n0, n1, y, n); break;
      }
    }
    return;
  }
  const int64_t row_bytes = k / QK * block_bytes(F);
  const int64_t tiles = (n + NT - 1) / NT;
  // Activation rows per pass: as many as stay in a core's L2 beside the weights.
  const int64_t chunk = std::max<int64_t>(MT, (256 * 1024 / (k * 4)) / MT * MT);
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    std::vector<float> buf(NT * k);
    const int64_t first = tiles * t / nt, last = tiles * (t + 1) / nt;
    for (int64_t m0 = 0; m0 < m; m0 += chunk) {
      const int64_t m1 = std::min(m, m0 + chunk);
      for (int64_t tn = first; tn < last; ++tn) {
        const int64_t n0 = tn * NT;
        const int cols = (int)std::min<int64_t>(NT, n - n0);
        const float* wt = (const float*)(w + n0 * row_bytes);  // F32 rows are used where they are
        if constexpr (F != F32) {
          dequantize_rows<F>(w + n0 * row_bytes, cols, k, buf.data());
          wt = buf.data();
        }
        for (int64_t i = m0; i < m1; i += MT) {
          const int rows = (int)std::min<int64_t>(MT, m1 - i);
          tile_any(rows, cols, x + i * k, wt, k, y + i * n + n0, n);
        }
      }
    }
  }
}

}  // namespace

extern "C" {

// Returns 0, or -1 for an unknown format, -2 for k not a multiple of 32.
int tm_block_gemm(int fmt, const float* x, int64_t m, int64_t k, const uint8_t* w, int64_t n, float* y,
                  int threads) {
  if (k % QK) return -2;
  switch (fmt) {
    case F32: gemm<F32>(x, m, k, w, n, y, threads); return 0;
    case Q4_0: gemm<Q4_0>(x, m, k, w, n, y, threads); return 0;
    case Q4_1: gemm<Q4_1>(x, m, k, w, n, y, threads); return 0;
    case Q5_0: gemm<Q5_0>(x, m, k, w, n, y, threads); return 0;
    case Q5_1: gemm<Q5_1>(x, m, k, w, n, y, threads); return 0;
    case IQ4_NL: gemm<IQ4_NL>(x, m, k, w, n, y, threads); return 0;
    case MXFP4: gemm<MXFP4>(x, m, k, w, n, y, threads); return 0;
    case Q8_0: gemm<Q8_0>(x, m, k, w, n, y, threads); return 0;
    default: return -1;
  }
}

// Dequantizes n rows of k weights into out (float32 [n, k]): what the product multiplies by.
int tm_block_dequantize(int fmt, const uint8_t* w, int64_t n, int64_t k, float* out) {
  if (k % QK) return -2;
  switch (fmt) {
    case F32: dequantize_rows<F32>(w, n, k, out); return 0;
    case Q4_0: dequantize_rows<Q4_0>(w, n, k, out); return 0;
    case Q4_1: dequantize_rows<Q4_1>(w, n, k, out); return 0;
    case Q5_0: dequantize_rows<Q5_0>(w, n, k, out); return 0;
    case Q5_1: dequantize_rows<Q5_1>(w, n, k, out); return 0;
    case IQ4_NL: dequantize_rows<IQ4_NL>(w, n, k, out); return 0;
    case MXFP4: dequantize_rows<MXFP4>(w, n, k, out); return 0;
    case Q8_0: dequantize_rows<Q8_0>(w, n, k, out); return 0;
    default: return -1;
  }
}
}
