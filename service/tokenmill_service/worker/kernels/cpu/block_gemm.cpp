// y[M, N] = x[M, K] @ W[N, K]^T for W in GGUF's block formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, MXFP4) kept as stored,
// or plain float32 rows (F32, --quantization none: the same fixed order, nothing to dequantize),
// float32 activations and output. Written in simd.h's ops: built per instruction set by build.py, the same
// bits from each.
//
// Two promises shape the code:
// - Faithful: each weight is dequantized exactly as gguf does (q * d, + m for Q4_1 and Q5_1, level[q] * d
//   for IQ4_NL and MXFP4; q * d is exact
//   in float32, so the fused multiply-add rounds once, like the multiply-then-add it replaces) and
//   the products are summed in float32.
// - Batch-invariant: every output y[i, n] is reduced in one fixed order (16 float32 lanes over K
//   in steps of 16, then simd.h's fixed tree over the lanes, reduce_add), whatever M is, how the rows
//   are tiled and how the outputs are split between threads. A sequence's result never depends on its
//   batch, nor on the instruction set.
//
// Speed: a tile of weight rows is dequantized once into a small float32 buffer (L1) and reused by
// every activation row; a register tile of accumulators (6 x 4 on AVX-512) keeps the FMA units busy.

#include <omp.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include "simd.h"
#include "tm_abi.h"  // the block formats and this file's prototypes (generated from abi.py)

namespace {

using namespace simd;

constexpr int64_t QK = TM_QK;  // weights per block in every format
constexpr int NT = 4;          // weight rows per dequantized tile (and per thread's share)
// The register tile: MT activation rows x NR weight rows of accumulators, with MT rows of activations and
// one weight vector beside them: 6 x 4 in 32 registers (AVX-512), 2 x 2 where a vector takes two or four
// registers (AVX2's 16 ymm, NEON's 32 q). The tile changes the speed only: each output's sum is the same.
constexpr bool WIDE = VECTOR_REGISTERS >= 32;
constexpr int MT = WIDE ? 6 : 2;
constexpr int NR = WIDE ? 4 : 2;

inline f32x16 half_at(const uint8_t* p) {
  uint16_t h;
  memcpy(&h, p, 2);
  return set1(half_to_float(h));
}

// ggml's kvalues_mxfp4 (e2m1 times 2) and kvalues_iq4nl, as int32 lanes for permute_i.
alignas(64) constexpr int32_t MXFP4_LEVELS[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
alignas(64) constexpr int32_t IQ4_NL_LEVELS[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                                   1,    13,   25,  38,  53,  69,  89,  113};

// One block of 32 weights, dequantized into registers (lo: weights 0..15, hi: 16..31). GGUF's 4-bit
// layout: byte j holds weight j in its low nibble and weight j + 16 in its high nibble (the 16 bytes
// widened to int32 lanes: the low nibble is the lane & 15, the high one the lane >> 4).
template <int F>
inline void dequantize_regs(const uint8_t* b, f32x16& lo, f32x16& hi) {
  if constexpr (F == F32) {
    lo = load((const float*)b);
    hi = load((const float*)b + 16);
    return;
  }
  if constexpr (F == MXFP4) {  // E | qs[16]: value[index] * 2^(E - 128), ggml's kvalues_mxfp4 and e8m0 half
    const uint32_t e = b[0], bits = e < 2 ? 0x00200000u << e : (e - 1) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    const f32x16 d = set1(scale);
    const i32x16 table = load_i(MXFP4_LEVELS);
    const i32x16 q = load_u8_i(b + 1);
    lo = mul(to_float(permute_i(table, q)), d);  // permute_i reads the index's low 4 bits: the low nibble
    hi = mul(to_float(permute_i(table, shr_i(q, 4))), d);
    return;
  }
  const f32x16 d = half_at(b);
  if constexpr (F == Q8_0) {
    lo = mul(to_float(load_s8_i((const int8_t*)(b + 2))), d);
    hi = mul(to_float(load_s8_i((const int8_t*)(b + 18))), d);
  } else if constexpr (F == Q5_0 || F == Q5_1) {  // d | (Q5_1: m) | qh u32 (bit j: weight j's fifth bit) | qs[16]
    const uint8_t* h = b + (F == Q5_1 ? 4 : 2);
    uint32_t qh;
    memcpy(&qh, h, 4);
    const i32x16 q = load_u8_i(h + 4);
    const i32x16 sixteen = set1_i(16);
    i32x16 ql = and_i(q, set1_i(0x0F)), qu = shr_i(q, 4);
    ql = select_i((lanes)(qh & 0xFFFF), add_i(ql, sixteen), ql);
    qu = select_i((lanes)(qh >> 16), add_i(qu, sixteen), qu);
    if constexpr (F == Q5_1) {
      const f32x16 m = half_at(b + 2);
      lo = fmadd(to_float(ql), d, m);
      hi = fmadd(to_float(qu), d, m);
    } else {  // (q - 16) * d
      lo = mul(to_float(sub_i(ql, sixteen)), d);
      hi = mul(to_float(sub_i(qu, sixteen)), d);
    }
  } else if constexpr (F == IQ4_NL) {  // d | qs[16]: level[index] * d, ggml's kvalues_iq4nl
    const i32x16 table = load_i(IQ4_NL_LEVELS);
    const i32x16 q = load_u8_i(b + 2);
    lo = mul(to_float(permute_i(table, q)), d);
    hi = mul(to_float(permute_i(table, shr_i(q, 4))), d);
  } else {
    const i32x16 q = load_u8_i(b + (F == Q4_1 ? 4 : 2));
    const i32x16 ql = and_i(q, set1_i(0x0F)), qu = shr_i(q, 4);
    if constexpr (F == Q4_1) {
      const f32x16 m = half_at(b + 2);
      lo = fmadd(to_float(ql), d, m);
      hi = fmadd(to_float(qu), d, m);
    } else {  // Q4_0: (q - 8) * d
      const i32x16 eight = set1_i(8);
      lo = mul(to_float(sub_i(ql, eight)), d);
      hi = mul(to_float(sub_i(qu, eight)), d);
    }
  }
}

template <int F>
inline void dequantize_block(const uint8_t* b, float* out) {
  f32x16 lo, hi;
  dequantize_regs<F>(b, lo, hi);
  store(out, lo);
  store(out + 16, hi);
}

// Writes the sums of acc[0..n) (n <= 4) to y[0..n), each over its 16 lanes in simd.h's one fixed tree
// (whichever slot an accumulator is in): x_i = (l_i + l_{i+8}) + (l_{i+4} + l_{i+12}) for i < 4, then
// (x_0 + x_2) + (x_1 + x_3). Four at once where there are four (one pass on AVX-512); N: the most there
// can be. Always inlined: g++ called it, once per weight row of F32 at one activation row, with the
// accumulator stored and reloaded around the call (the product 1.12x slower from L3).
template <int N>
__attribute__((always_inline)) inline void store_sums(const f32x16* acc, int n, float* y) {
  if constexpr (N == 4) {
    if (n == 4) {
      reduce_add4(acc[0], acc[1], acc[2], acc[3], y);
      return;
    }
  }
  for (int j = 0; j < n; ++j) y[j] = reduce_add(acc[j]);
}

template <int F>
void dequantize_rows(const uint8_t* w, int64_t rows, int64_t k, float* out) {
  const int64_t blocks = k / QK, bytes = tm_native_block_bytes(F);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < blocks; ++b) dequantize_block<F>(w + (r * blocks + b) * bytes, out + r * k + b * QK);
}

// y[i, j] for the M x N tile at x (rows of k, stride k) and w (N dequantized rows of k).
template <int M, int N>
inline void tile(const float* x, const float* w, int64_t k, float* y, int64_t ldy) {
  f32x16 acc[M][N];
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < N; ++j) acc[i][j] = zero_f();
  for (int64_t c = 0; c < k; c += 16) {
    f32x16 xv[M];
    for (int i = 0; i < M; ++i) xv[i] = load(x + i * k + c);
    for (int j = 0; j < N; ++j) {
      const f32x16 wv = load(w + j * k + c);
      for (int i = 0; i < M; ++i) acc[i][j] = fmadd(wv, xv[i], acc[i][j]);
    }
  }
  for (int i = 0; i < M; ++i) store_sums<N>(acc[i], N, y + i * ldy);
}

// tile<m, n> for run-time m <= M and n <= N.
template <int M = MT, int N = NR>
inline void tile_any(int m, int n, const float* x, const float* w, int64_t k, float* y, int64_t ldy) {
  if constexpr (M > 1) {
    if (m < M) return tile_any<M - 1, N>(m, n, x, w, k, y, ldy);
  }
  if constexpr (N > 1) {
    if (n < N) return tile_any<M, N - 1>(m, n, x, w, k, y, ldy);
  }
  tile<M, N>(x, w, k, y, ldy);
}

// Weight rows a pass of few_rows takes (its M x step accumulators beside the activations' 2M vectors).
// F32 rows are 4 bytes a weight and the product waits on memory: one weight row at a time, so
// that each thread reads one sequential stream (1.4-1.75x faster from DRAM than 4 interleaved
// rows, measured at 1-4 rows on an AMD EPYC). The quantized formats wait on their arithmetic and
// keep NT on AVX-512; with 16 ymm (AVX2) one row measured fastest (at 4 rows, 2 or 4 a pass were
// 1.1-1.35x slower: their accumulators spill), and NEON has no more room.
template <int F>
constexpr int few_step() {
  return F == F32 || !WIDE ? 1 : NT;
}

// Few rows (decode of a few sequences): each block is dequantized into registers and used at once,
// with no buffer. The accumulators see the same multiply-adds in the same order as in tile(), so
// a row's result is the same whichever path its batch takes (and whatever the step: each output's sum
// is the same, store_sums' tree does not depend on its slot).
template <int F, int M>
void few_rows(const float* x, int64_t k, const uint8_t* w, int64_t n0, int64_t n1, float* y, int64_t ldy) {
  const int64_t blocks = k / QK, bytes = tm_native_block_bytes(F), row_bytes = blocks * bytes;
  constexpr int step = few_step<F>();
  for (int64_t r0 = n0; r0 < n1; r0 += step) {
    const int cols = (int)std::min<int64_t>(step, n1 - r0);
    f32x16 acc[M][step];
    for (int i = 0; i < M; ++i)
      for (int j = 0; j < step; ++j) acc[i][j] = zero_f();
    for (int64_t b = 0; b < blocks; ++b) {
      f32x16 xl[M], xh[M];
      for (int i = 0; i < M; ++i) {
        xl[i] = load(x + i * k + b * QK);
        xh[i] = load(x + i * k + b * QK + 16);
      }
      for (int j = 0; j < step; ++j) {
        if (j >= cols) break;
        f32x16 wl, wh;
        dequantize_regs<F>(w + (r0 + j) * row_bytes + b * bytes, wl, wh);
        for (int i = 0; i < M; ++i) {
          acc[i][j] = fmadd(wl, xl[i], acc[i][j]);
          acc[i][j] = fmadd(wh, xh[i], acc[i][j]);
        }
      }
    }
    for (int i = 0; i < M; ++i) store_sums<step>(acc[i], cols, y + i * ldy + r0);
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
  const int64_t row_bytes = k / QK * tm_native_block_bytes(F);
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
          for (int j = 0; j < cols; j += NR)
            tile_any(rows, std::min(NR, cols - j), x + i * k, wt + j * k, k, y + i * n + n0 + j, n);
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
