// LoRA adapters' deltas added to a layer's product, grouped by adapter (SGMV, as Punica and S-LoRA run
// it): y[row] += (x[row] @ A[slot].T) @ B[slot].T for each row of each adapter slot in the step, in one
// call for every slot and every part of a packed layer (layers/lora/slots.py lays the slots out; the
// eager layers and the native decoder stack both call this).
//
// Layout (dtype float32 or bfloat16, TM_LORA_*): A [slots, parts, max_rank, in], B transposed
// [slots, max_rank, out], the scale folded into B; ranks [slots, parts]: the rows of each block the
// slot's adapter fills (0: the part is not targeted), the only rows read. Part p's output columns
// (part_rows[2p] on, part_rows[2p + 1] of them) are the product of A's block p.
//
// One parallel loop, one work item per (group, part, up to 12 of the group's rows): the item shrinks its
// rows, mid[i, p, r] = x[row i] . A[slot, p, r] (register tiles of 6 rows x 4 rank rows), then expands
// them, y[row i, columns] += sum over r of mid[i, p, r] * Bt[slot, r, columns] (tiles of 4 rows x 64
// columns, 16 columns per vector, no horizontal sums). An item reads only its own rows' shrunk values,
// so no barrier divides the two: the call waits for the threads once, at its end. (With two loops, every
// shrink, a barrier, then every expand, a 237-token mixed step over 8 adapters ran at 0.49x of the base's
// speed against 0.66x with one, on a machine shared with other work, where a thread that waits spins
// while the one it waits for is descheduled, so a step's time grows with its barriers; in CPU time the
// one loop is also 2-3 % cheaper, though a slot's A and B are read once per 12 rows instead of once a
// step: from the core's cache after the first.)
//
// Batch invariance: every output is one fixed sequence of float32 operations on its own row's inputs.
// A shrunk value sums 16 float32 lanes over `in` in steps of 16, then one fixed tree over the lanes (as
// block_gemm.cpp's); an expanded one sums over r in order from 0, then is added to y. Which rows share a
// tile or an item, how many rows a group has and which thread takes an item change none of them.
// bfloat16 weights widen to float32 exactly.
// Built and loaded by kernels/cpu/build.py (g++ -O3 -march=native -fopenmp).

#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include "tm_abi.h"  // TmLoraBatch, TM_LORA_* and this file's prototype

#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VL__)
#error "lora needs AVX-512F, BW and VL"
#endif

namespace {

constexpr int MT = 6;         // rows per shrink tile
constexpr int RT = 4;         // rank rows per shrink tile
constexpr int ET = 4;         // rows per expand tile
constexpr int64_t CW = 64;    // columns per expand tile (4 vectors)

// 16 weights at element e of w, widened to float32.
template <int D>
inline __m512 load16(const uint8_t* w, int64_t e) {
  if constexpr (D == TM_LORA_FLOAT32) {
    return _mm512_loadu_ps((const float*)w + e);
  } else {
    const __m256i h = _mm256_loadu_si256((const __m256i*)((const uint16_t*)w + e));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

template <int D>
constexpr int64_t elem_bytes() {
  return D == TM_LORA_FLOAT32 ? 4 : 2;
}

// The sums of four accumulators' 16 lanes, in block_gemm.cpp's fixed tree.
inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(c, d, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 s = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 p = _mm512_add_ps(s, _mm512_permute_ps(s, _MM_SHUFFLE(1, 0, 3, 2)));
  const __m512 q = _mm512_add_ps(p, _mm512_permute_ps(p, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm512_castps512_ps128(
      _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), q));
}

// mid[i * ld + j] = x[rows[i]] . a_j for M rows and N (<= RT) rows of A (a: A's row 0 of the item, rows
// of k elements).
template <int D, int M>
inline void shrink_tile(const float* x, const int64_t* rows, int64_t k, const uint8_t* a, int n, float* mid,
                        int64_t ld) {
  __m512 acc[M][RT];
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < RT; ++j) acc[i][j] = _mm512_setzero_ps();
  const float* xr[M];
  for (int i = 0; i < M; ++i) xr[i] = x + rows[i] * k;
  for (int64_t c = 0; c < k; c += 16) {
    __m512 xv[M];
    for (int i = 0; i < M; ++i) xv[i] = _mm512_loadu_ps(xr[i] + c);
    for (int j = 0; j < RT; ++j) {
      if (j >= n) break;
      const __m512 wv = load16<D>(a, j * k + c);
      for (int i = 0; i < M; ++i) acc[i][j] = _mm512_fmadd_ps(wv, xv[i], acc[i][j]);
    }
  }
  const __m512 z = _mm512_setzero_ps();
  for (int i = 0; i < M; ++i) {
    const __m128 s = sum4(acc[i][0], n > 1 ? acc[i][1] : z, n > 2 ? acc[i][2] : z, n > 3 ? acc[i][3] : z);
    _mm_mask_storeu_ps(mid + i * ld, (__mmask8)((1u << n) - 1), s);
  }
}

template <int D>
void shrink(const float* x, const int64_t* rows, int64_t m, int64_t k, const uint8_t* a, int n, float* mid,
            int64_t ld) {
  for (int64_t i = 0; i < m; i += MT) {
    switch (std::min<int64_t>(MT, m - i)) {
      case 6: shrink_tile<D, 6>(x, rows + i, k, a, n, mid + i * ld, ld); break;
      case 5: shrink_tile<D, 5>(x, rows + i, k, a, n, mid + i * ld, ld); break;
      case 4: shrink_tile<D, 4>(x, rows + i, k, a, n, mid + i * ld, ld); break;
      case 3: shrink_tile<D, 3>(x, rows + i, k, a, n, mid + i * ld, ld); break;
      case 2: shrink_tile<D, 2>(x, rows + i, k, a, n, mid + i * ld, ld); break;
      default: shrink_tile<D, 1>(x, rows + i, k, a, n, mid + i * ld, ld); break;
    }
  }
}

// y[rows[i], c0 .. c0 + cols) += sum_r mid[i * ld + r] * bt[r * out + c0 ..] for r < rank, M rows, V
// vectors of 16 columns (the last `tail` wide where tail > 0). M and V are compile-time so that the M x V
// accumulators stay in registers (with V a run-time bound g++ kept them on the stack: a load and a store
// around every FMA, measured 55 % of a mixed-adapter step's LoRA time).
template <int D, int M, int V>
inline void expand_tile(const float* mid, int64_t ld, int64_t rank, const uint8_t* bt, int64_t out, int64_t c0,
                        int tail, const int64_t* rows, float* y) {
  // The accumulators as named registers of a flat array, and the tail's mask decided once: with a
  // two-dimensional array and a per-vector tail test g++ also stored every accumulator to the stack on
  // every step of r.
  __m512 acc[M * V];
  #pragma GCC unroll 16
  for (int j = 0; j < M * V; ++j) acc[j] = _mm512_setzero_ps();
  const __mmask16 last = tail ? (__mmask16)((1u << tail) - 1) : (__mmask16)0xFFFF;
  const uint16_t* b16 = (const uint16_t*)bt;
  const float* b32 = (const float*)bt;
  for (int64_t r = 0; r < rank; ++r) {
    __m512 bv[V];
    const int64_t e = r * out + c0;
    #pragma GCC unroll 16
    for (int q = 0; q < V; ++q) {
      const __mmask16 mask = q == V - 1 ? last : (__mmask16)0xFFFF;
      if constexpr (D == TM_LORA_FLOAT32) {
        bv[q] = _mm512_maskz_loadu_ps(mask, b32 + e + 16 * q);
      } else {
        const __m256i h = _mm256_maskz_loadu_epi16(mask, b16 + e + 16 * q);
        bv[q] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
      }
    }
    #pragma GCC unroll 16
    for (int i = 0; i < M; ++i) {
      const __m512 mv = _mm512_set1_ps(mid[i * ld + r]);
      #pragma GCC unroll 16
      for (int q = 0; q < V; ++q) acc[i * V + q] = _mm512_fmadd_ps(mv, bv[q], acc[i * V + q]);
    }
  }
  #pragma GCC unroll 16
  for (int i = 0; i < M; ++i) {
    float* yr = y + rows[i] * out + c0;
    #pragma GCC unroll 16
    for (int q = 0; q < V; ++q) {
      const __mmask16 mask = q == V - 1 ? last : (__mmask16)0xFFFF;
      const __m512 cur = _mm512_maskz_loadu_ps(mask, yr + 16 * q);
      _mm512_mask_storeu_ps(yr + 16 * q, mask, _mm512_add_ps(cur, acc[i * V + q]));
    }
  }
}

template <int D, int V>
void expand_rows(const float* mid, int64_t ld, int64_t m, int64_t rank, const uint8_t* bt, int64_t out, int64_t c0,
                 int tail, const int64_t* rows, float* y) {
  for (int64_t i = 0; i < m; i += ET) {
    switch (std::min<int64_t>(ET, m - i)) {
      case 4: expand_tile<D, 4, V>(mid + i * ld, ld, rank, bt, out, c0, tail, rows + i, y); break;
      case 3: expand_tile<D, 3, V>(mid + i * ld, ld, rank, bt, out, c0, tail, rows + i, y); break;
      case 2: expand_tile<D, 2, V>(mid + i * ld, ld, rank, bt, out, c0, tail, rows + i, y); break;
      default: expand_tile<D, 1, V>(mid + i * ld, ld, rank, bt, out, c0, tail, rows + i, y); break;
    }
  }
}

template <int D>
void expand(const float* mid, int64_t ld, int64_t m, int64_t rank, const uint8_t* bt, int64_t out, int64_t c0,
            int64_t cols, const int64_t* rows, float* y) {
  static_assert(CW == 64, "expand dispatches on up to 4 vectors of 16 columns");
  const int tail = (int)(cols % 16);
  switch ((cols + 15) / 16) {
    case 4: expand_rows<D, 4>(mid, ld, m, rank, bt, out, c0, tail, rows, y); break;
    case 3: expand_rows<D, 3>(mid, ld, m, rank, bt, out, c0, tail, rows, y); break;
    case 2: expand_rows<D, 2>(mid, ld, m, rank, bt, out, c0, tail, rows, y); break;
    default: expand_rows<D, 1>(mid, ld, m, rank, bt, out, c0, tail, rows, y); break;
  }
}

constexpr int64_t RC = 12;  // rows per work item: two shrink tiles, three expand tiles

// A work item: rows first .. first + count of one group, through one part's A and B.
struct Item {
  int64_t group, part, first, count;
};

template <int D>
void lora_add(const float* x, int64_t in, const TmLoraBatch* batch, const uint8_t* a, const uint8_t* bt,
              const int64_t* ranks, int64_t max_rank, int64_t parts, const int64_t* part_rows, int64_t out, float* y,
              float* mid, int threads) {
  const int64_t width = parts * max_rank;  // mid's row: each part's max_rank shrunk values
  std::vector<Item> items;
  for (int64_t g = 0; g < batch->groups; ++g) {
    const int64_t slot = batch->slots[g], m = batch->offsets[g + 1] - batch->offsets[g];
    for (int64_t p = 0; p < parts; ++p)
      if (ranks[slot * parts + p])
        for (int64_t i = 0; i < m; i += RC) items.push_back({g, p, i, std::min<int64_t>(RC, m - i)});
  }
  const int64_t n = (int64_t)items.size();
  if (!n) return;
  const int64_t eb = elem_bytes<D>();
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t it = 0; it < n; ++it) {
    const Item& w = items[it];
    const int64_t slot = batch->slots[w.group], begin = batch->offsets[w.group] + w.first;
    const int64_t rank = ranks[slot * parts + w.part];
    const int64_t* rows = batch->rows + begin;
    float* m = mid + begin * width + w.part * max_rank;  // these rows' shrunk values of this part
    const uint8_t* ap = a + (slot * parts + w.part) * max_rank * in * eb;
    for (int64_t r = 0; r < rank; r += RT)
      shrink<D>(x, rows, w.count, in, ap + r * in * eb, (int)std::min<int64_t>(RT, rank - r), m + r, width);
    const uint8_t* bs = bt + slot * max_rank * out * eb;
    const int64_t c0 = part_rows[2 * w.part], cols = part_rows[2 * w.part + 1];
    for (int64_t c = 0; c < cols; c += CW)
      expand<D>(m, width, w.count, rank, bs, out, c0 + c, std::min<int64_t>(CW, cols - c), rows, y);
  }
}

}  // namespace

extern "C" {

// y [t, out] += each of the batch's rows' delta; x [t, in]; scratch: t * parts * max_rank floats (t: the
// batch's rows). Returns 0, or -1 for an unknown dtype, -2 for `in` not a multiple of 16.
int tm_lora_add(int dtype, const float* x, int64_t in, const TmLoraBatch* batch, const uint8_t* a,
                const uint8_t* bt, const int64_t* ranks, int64_t max_rank, int64_t parts, const int64_t* part_rows,
                int64_t out, float* y, float* scratch, int threads) {
  if (in % 16) return -2;
  switch (dtype) {
    case TM_LORA_FLOAT32:
      lora_add<TM_LORA_FLOAT32>(x, in, batch, a, bt, ranks, max_rank, parts, part_rows, out, y, scratch, threads);
      return 0;
    case TM_LORA_BFLOAT16:
      lora_add<TM_LORA_BFLOAT16>(x, in, batch, a, bt, ranks, max_rank, parts, part_rows, out, y, scratch, threads);
      return 0;
    default: return -1;
  }
}
}
