// LoRA adapters' deltas added to a layer's product, grouped by adapter (SGMV, as Punica and S-LoRA run
// it): y[row] += (x[row] @ A[slot].T) @ B[slot].T for each row of each adapter slot in the step, in one
// call for every slot and every part of a packed layer (worker/layers/lora/slots.py lays the slots out; the
// eager layers and the native decoder stack both call this).
//
// Layout (dtype float32 or bfloat16, TM_LORA_*): A [slots, parts, max_rank, in], B transposed
// [slots, max_rank, out], the scale folded into B; ranks [slots, parts]: the rows of each block the
// slot's adapter fills (0: the part is not targeted), the only rows read. Part p's output columns
// (part_rows[2p] on, part_rows[2p + 1] of them) are the product of A's block p.
//
// One parallel loop, one work item per (group, part, up to 12 of the group's rows): the item shrinks its
// rows, mid[i, p, r] = x[row i] . A[slot, p, r] (register tiles of 6 rows x 4 rank rows on AVX-512), then
// expands them, y[row i, columns] += sum over r of mid[i, p, r] * Bt[slot, r, columns] (tiles of 4 rows x 64
// columns on AVX-512, 16 columns per vector, no horizontal sums). An item reads only its own rows' shrunk
// values, so no barrier divides the two: the call waits for the threads once, at its end. (With two loops,
// every shrink, a barrier, then every expand, a 237-token mixed step over 8 adapters ran at 0.49x of the
// base's speed against 0.66x with one, on a machine shared with other work, where a thread that waits spins
// while the one it waits for is descheduled, so a step's time grows with its barriers; in CPU time the one
// loop is also 2-3 % cheaper, though a slot's A and B are read once per 12 rows instead of once a step: from
// the core's cache after the first.)
//
// Batch invariance: every output is one fixed sequence of float32 operations on its own row's inputs.
// A shrunk value sums 16 float32 lanes over `in` in steps of 16, then one fixed tree over the lanes (as
// block_gemm.cpp's); an expanded one sums over r in order from 0, then is added to y. Which rows share a
// tile or an item, how many rows a group has and which thread takes an item change none of them.
// bfloat16 weights widen to float32 exactly. Written in simd.h's ops: built per instruction set by
// worker/kernels/cpu/build.py, the same bits from each.

#include <omp.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include "simd.h"
#include "tm_abi.h"  // TmLoraBatch, TM_LORA_* and this file's prototype

namespace {

using namespace simd;

// The register tiles, by how many vectors the registers hold (32 on AVX-512; 8 where a vector takes two or
// four registers: AVX2, NEON). They change the speed only: every output's arithmetic is the same.
constexpr bool WIDE = VECTOR_REGISTERS >= 32;
constexpr int MT = WIDE ? 6 : 2;           // rows per shrink tile
constexpr int RT = WIDE ? 4 : 2;           // rank rows per shrink tile
constexpr int ET = WIDE ? 4 : 2;           // rows per expand tile
constexpr int64_t CW = WIDE ? 64 : 32;     // columns per expand tile (CW / 16 vectors)

// 16 weights at element e of w, widened to float32.
template <int D>
inline f32x16 load16(const uint8_t* w, int64_t e) {
  if constexpr (D == TM_LORA_FLOAT32) {
    return load((const float*)w + e);
  } else {
    return load_bf16((const uint16_t*)w + e);
  }
}

template <int D>
constexpr int64_t elem_bytes() {
  return D == TM_LORA_FLOAT32 ? 4 : 2;
}

// mid[i * ld + j] = x[rows[i]] . a_j for M rows and N (<= RT) rows of A (a: A's row 0 of the item, rows
// of k elements). Each sum over its 16 lanes in simd.h's fixed tree (as block_gemm.cpp's), four at once
// where there are four.
template <int D, int M>
inline void shrink_tile(const float* x, const int64_t* rows, int64_t k, const uint8_t* a, int n, float* mid,
                        int64_t ld) {
  f32x16 acc[M][RT];
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < RT; ++j) acc[i][j] = zero_f();
  const float* xr[M];
  for (int i = 0; i < M; ++i) xr[i] = x + rows[i] * k;
  for (int64_t c = 0; c < k; c += 16) {
    f32x16 xv[M];
    for (int i = 0; i < M; ++i) xv[i] = load(xr[i] + c);
    for (int j = 0; j < RT; ++j) {
      if (j >= n) break;
      const f32x16 wv = load16<D>(a, j * k + c);
      for (int i = 0; i < M; ++i) acc[i][j] = fmadd(wv, xv[i], acc[i][j]);
    }
  }
  for (int i = 0; i < M; ++i) {
    if constexpr (RT == 4) {
      if (n == 4) {
        reduce_add4(acc[i][0], acc[i][1], acc[i][2], acc[i][3], mid + i * ld);
        continue;
      }
    }
    for (int j = 0; j < n; ++j) mid[i * ld + j] = reduce_add(acc[i][j]);
  }
}

// shrink_tile<m> for run-time m <= M.
template <int D, int M = MT>
inline void shrink_any(int m, const float* x, const int64_t* rows, int64_t k, const uint8_t* a, int n, float* mid,
                       int64_t ld) {
  if constexpr (M > 1) {
    if (m < M) return shrink_any<D, M - 1>(m, x, rows, k, a, n, mid, ld);
  }
  shrink_tile<D, M>(x, rows, k, a, n, mid, ld);
}

template <int D>
void shrink(const float* x, const int64_t* rows, int64_t m, int64_t k, const uint8_t* a, int n, float* mid,
            int64_t ld) {
  for (int64_t i = 0; i < m; i += MT)
    shrink_any<D>((int)std::min<int64_t>(MT, m - i), x, rows + i, k, a, n, mid + i * ld, ld);
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
  // every step of r. The last vector's loads and stores are masked (lanes past the tail read as 0 and
  // are not written); the others are whole.
  f32x16 acc[M * V];
  #pragma GCC unroll 16
  for (int j = 0; j < M * V; ++j) acc[j] = zero_f();
  const lanes last = first_lanes(tail ? tail : 16);
  const uint16_t* b16 = (const uint16_t*)bt;
  const float* b32 = (const float*)bt;
  for (int64_t r = 0; r < rank; ++r) {
    f32x16 bv[V];
    const int64_t e = r * out + c0;
    #pragma GCC unroll 16
    for (int q = 0; q < V; ++q) {
      if constexpr (D == TM_LORA_FLOAT32) {
        bv[q] = q == V - 1 ? load_masked(b32 + e + 16 * q, last) : load(b32 + e + 16 * q);
      } else {
        bv[q] = q == V - 1 ? load_bf16_masked(b16 + e + 16 * q, last) : load_bf16(b16 + e + 16 * q);
      }
    }
    #pragma GCC unroll 16
    for (int i = 0; i < M; ++i) {
      const f32x16 mv = set1(mid[i * ld + r]);
      #pragma GCC unroll 16
      for (int q = 0; q < V; ++q) acc[i * V + q] = fmadd(mv, bv[q], acc[i * V + q]);
    }
  }
  #pragma GCC unroll 16
  for (int i = 0; i < M; ++i) {
    float* yr = y + rows[i] * out + c0;
    #pragma GCC unroll 16
    for (int q = 0; q < V; ++q) {
      if (q == V - 1) {
        store_masked(yr + 16 * q, last, add(load_masked(yr + 16 * q, last), acc[i * V + q]));
      } else {
        store(yr + 16 * q, add(load(yr + 16 * q), acc[i * V + q]));
      }
    }
  }
}

// expand_tile<m, V> for run-time m <= M.
template <int D, int V, int M = ET>
inline void expand_any(int m, const float* mid, int64_t ld, int64_t rank, const uint8_t* bt, int64_t out, int64_t c0,
                       int tail, const int64_t* rows, float* y) {
  if constexpr (M > 1) {
    if (m < M) return expand_any<D, V, M - 1>(m, mid, ld, rank, bt, out, c0, tail, rows, y);
  }
  expand_tile<D, M, V>(mid, ld, rank, bt, out, c0, tail, rows, y);
}

template <int D, int V>
void expand_rows(const float* mid, int64_t ld, int64_t m, int64_t rank, const uint8_t* bt, int64_t out, int64_t c0,
                 int tail, const int64_t* rows, float* y) {
  for (int64_t i = 0; i < m; i += ET)
    expand_any<D, V>((int)std::min<int64_t>(ET, m - i), mid + i * ld, ld, rank, bt, out, c0, tail, rows + i, y);
}

// expand_rows<v> for the run-time count of vectors v <= V.
template <int D, int V = CW / 16>
void expand(const float* mid, int64_t ld, int64_t m, int64_t rank, const uint8_t* bt, int64_t out, int64_t c0,
            int64_t cols, const int64_t* rows, float* y) {
  if constexpr (V > 1) {
    if ((cols + 15) / 16 < V) return expand<D, V - 1>(mid, ld, m, rank, bt, out, c0, cols, rows, y);
  }
  expand_rows<D, V>(mid, ld, m, rank, bt, out, c0, (int)(cols % 16), rows, y);
}

constexpr int64_t RC = 12;  // rows per work item: two shrink tiles, three expand tiles (AVX-512)

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
