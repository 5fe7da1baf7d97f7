// What the integer-product kernels (vnni_gemm.cpp, kquant_gemm.cpp) share: the activations as
// 16-bit fixed point per block of 32 (two int8 digits, or the same value as one int16; the numerics are
// described at the top of vnni_gemm.cpp), and the driver that quantizes the rows and hands tiles of rows and weight groups
// to the threads. A row's result never depends on the other rows, the tiling or the thread count:
// each output's sums run in one fixed order inside a tile, whatever tile computes it.
#pragma once

#include <omp.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "simd.h"
#include "tm_abi.h"

namespace vnni {

using namespace simd;

// Calls f(std::integral_constant<int, F>{}) for the F among Fs equal to fmt, so that a kernel's templates are
// instantiated once for each format it serves; returns `otherwise` for a format not among them.
template <int... Fs, class Fn>
int with_format(int fmt, int otherwise, Fn&& f) {
  int result = otherwise;
  (void)((fmt == Fs ? (result = f(std::integral_constant<int, Fs>{}), true) : false) || ...);
  return result;
}

constexpr int64_t QK = TM_QK;  // weights per activation block
constexpr int64_t G = 16;      // weight rows per packed group (one output per int32 lane)

inline uint16_t half_bits(const uint8_t* p) {
  uint16_t h;
  memcpy(&h, p, 2);
  return h;
}

// How far ahead of its reads a decoding tile (one group of rows, so the thread's weights are one stream) asks
// for its weights, and into L2 (prefetcht1). Measured from DRAM (quantized_gemm_speed.py --from-memory), an
// AMD EPYC: one thread's Q4_K product at one row read 16 GB/s with the hardware prefetchers alone (a plain
// streaming loop: 20), 23 with this; two threads' products at 2-4 rows took 0.5-0.9 of the time (Q8_0 at two
// rows the least helped, 0.8-0.9). 6-12 KB ahead measured alike; 2 KB, and prefetching into L1, measured slower than none. The block
// formats at one row (lighter on the core than the k-quants) measured no faster, Q8_0 1.1 times slower: they
// prefetched from two rows (one row too since, below). Weights whose group of rows spans less than the distance
// (SmolLM2-135M's K = 576) ask too: a thread's groups follow one another, so the lines ahead are its next groups'.
// Left out for them before (Q4_1 at 4 rows 1.1 times slower, 4 KB pages, a block's lines at its start); with a
// step's share and 2 MB pages, an Intel Xeon from memory, both cores, 1-4 rows: Q4_0 and Q4_1 at K = 576 0.71-0.88
// of the time, Q4_K at K = 512 and 768 0.49-0.68 (AVX2 0.52-0.82), 16 rows 0.72-1.0, 64 and 512 rows 0.9-1.0;
// the embedded model's decoder products 1.27 times as fast a token.
constexpr int64_t PREFETCH_AHEAD = 8192;

// A tile's step `part` of PARTS through BYTES of weights at p asks for the lines PREFETCH_AHEAD ahead that start
// in its share of them: one or two lines a step, each line once over the parts (a prefetch past the end of a
// mapping does not fault). Paced so, beside the loads that use the lines, rather than a block's or a
// super-block's lines all at its start: on an Intel Xeon, one decoding row from memory, the k-quants 1.07-1.15
// times as fast (kquant_gemm.cpp), Q4_0, Q4_1 and Q5_0 1.14-1.23 times.
template <int64_t BYTES, int64_t PARTS>
inline void prefetch_share(const uint8_t* p, int64_t part) {
  const uintptr_t start = (uintptr_t)(p + PREFETCH_AHEAD);
  const uintptr_t end = start + (part + 1) * BYTES / PARTS;
  for (uintptr_t line = (start + part * BYTES / PARTS + 63) & ~(uintptr_t)63; line < end; line += 64)
    simd::prefetch_l2((const void*)line);
}

inline int32_t dword_at(const int8_t* p) {
  int32_t v;
  memcpy(&v, p, 4);
  return v;
}

// The low digit lo (saturated to int8) beside the high digit hi8, such that 256 * hi8 + lo fits in int16, as
// quantize_row_words stores it: hi8 is -128 only where it saturated (see there), and then lo is kept >= 0.
inline i32x16 low_digit(i32x16 hi8, i32x16 lo8) {
  return select_i(equal_i(hi8, set1_i(-128)), max_i(lo8, zero_i()), lo8);
}

// One half block's 16 values t as two int8 digits (as int32 lanes): v = t / d = t * id, hi = round(v) (nearest,
// ties to even), lo = round(256 * (v - hi)), each saturated to int8 as stored. The remainder v - hi is exact in
// float32 (v and hi are within 0.5), and so is scaling it by 256.
inline void digits(f32x16 t, float id, i32x16& hi8, i32x16& lo8) {
  const f32x16 v = mul(t, set1(id));  // |v| <= 127 (up to rounding)
  const i32x16 hi = to_int(v);
  const i32x16 lo = to_int(mul(sub(v, to_float(hi)), set1(256.0f)));
  hi8 = saturate_i8(hi);
  lo8 = low_digit(hi8, saturate_i8(lo));
}

// Row i of x as fixed-point blocks, the block's unit dq, dq * sum(256 * hi + lo), and (if s16 is given) the
// integer sums sum(256 * hi + lo) of each half block of 16, for formats whose scales change every 16 weights.
// WORDS false (quantize_row): per block 32 hi digits then 32 lo digits (a: 2k bytes), for vpdpbusd.
// WORDS true (quantize_row_words): each weight's two digits as one int16, 256 * hi + lo, for vpdpwssd (int16
// pairs, exact int32 sums): per block 64 bytes, its 32 values in the order vpdpwssd pairs them with the packed
// weights' even and odd bytes (kquant_gemm.cpp): per 8 weights 0 2 1 3 4 6 5 7, so that its four dwords hold
// the pairs (x0, x2) (x1, x3) (x4, x6) (x5, x7).
//
// A word fits in int16: |v| = |x| / d <= 127 up to a few ulps of rounding (d = max|x| / 127), so hi = round(v)
// is in [-127, 127] and lo = round(256 (v - hi)) in [-128, 128] (128 saturated to 127): 256 * hi + lo lies in
// [-32640, 32639]. Only where 1 / d overflows (max|x| below about 3.7e-37, where the unit dq = d / 256 is below
// 1.2e-41) or x holds inf or NaN can v be infinite or NaN and hi saturate at -128; low_digit then keeps lo >= 0,
// so that the value stays within int16 here too and both forms hold the same integers (a row's bits do not
// depend on which form its batch takes).
// Packing: one row's block of 32 q (step t: weights 4t..4t+3) as its BITS-bit fields from bit FROM, into the
// block's 64-byte planes (step t in plane t / (8 / BITS), from bit (t % (8 / BITS)) * BITS; byte 4 * row + w
// for the row's weight 4t + w): the row's 4 bytes of each plane, written as one word each.
template <int BITS, int FROM>
inline void put_planes(const uint8_t* q, uint8_t* plane) {
  constexpr int per_byte = 8 / BITS;
  constexpr uint32_t mask = 0x01010101u * ((1u << BITS) - 1);
  for (int p = 0; p < BITS; ++p) {
    uint32_t word = 0;
    for (int u = 0; u < per_byte; ++u) {
      uint32_t four;
      memcpy(&four, q + 4 * (p * per_byte + u), 4);
      word |= ((four >> FROM) & mask) << (u * BITS);
    }
    memcpy(plane + 64 * p, &word, 4);
  }
}

// INT8 (quantize_row_int8, the opt-in 8-bit activations): only the high digits hi8 = round(x / d), the unit d
// itself (dq = d, sx = d * sum(hi)), llama.cpp's Q8_0 activations (d = max|x| / 127, round to nearest even), 32
// bytes a block one after another in the first k bytes of the row's 2k (block_at); a tile reads them as digits with
// the second pass left out. (Where the digits' hi halves sit, 64 bytes apart, half of each cache line a tile read
// went unused: a 4-row AVX2 tile read 16 KB of lines at K = 2048 beside its group's 18 KB of Q4_K, over L1's 32 KB.)
enum class Layout { DIGITS, WORDS, INT8 };

// Where block b of a row's activations starts: 64 bytes a block as digits and words, 32 as int8.
constexpr int64_t block_at(int64_t b, bool int8) { return b * (int8 ? QK : 2 * QK); }

template <Layout L>
inline void quantize_row_as(const float* x, int64_t k, int8_t* a, float* dq, float* sx, int32_t* s16) {
  alignas(64) static const int32_t word_order[16] = {0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15};
  const i32x16 order = load_i(word_order);
  for (int64_t b = 0; b < k / QK; ++b) {
    int32_t sum = 0;
    f32x16 t[2];
    t[0] = load(x + b * QK);
    t[1] = load(x + b * QK + 16);
    const float amax = reduce_max(max(abs(t[0]), abs(t[1])));
    const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    for (int h = 0; h < 2; ++h) {
      i32x16 hi8, lo8;
      digits(t[h], id, hi8, lo8);
      const i32x16 value = L == Layout::INT8 ? hi8 : add_i(shl_i(hi8, 8), lo8);  // in int16 (above)
      if constexpr (L == Layout::WORDS) {
        store_i16((int16_t*)(a + b * 2 * QK + h * 32), permute_i(value, order));
      } else if constexpr (L == Layout::INT8) {
        store_i8(a + block_at(b, true) + h * 16, hi8);
      } else {
        store_i8(a + b * 2 * QK + h * 16, hi8);
        store_i8(a + b * 2 * QK + QK + h * 16, lo8);
      }
      const int32_t half = reduce_add_i(value);
      if (s16) s16[2 * b + h] = half;
      sum += half;
    }
    dq[b] = L == Layout::INT8 ? d : d * (1.0f / 256.0f);
    sx[b] = dq[b] * (float)sum;
  }
}

inline void quantize_row(const float* x, int64_t k, int8_t* a, float* dq, float* sx, int32_t* s16) {
  quantize_row_as<Layout::DIGITS>(x, k, a, dq, sx, s16);
}

inline void quantize_row_words(const float* x, int64_t k, int8_t* a, float* dq, float* sx, int32_t* s16) {
  quantize_row_as<Layout::WORDS>(x, k, a, dq, sx, s16);
}

inline void quantize_row_int8(const float* x, int64_t k, int8_t* a, float* dq, float* sx, int32_t* s16) {
  quantize_row_as<Layout::INT8>(x, k, a, dq, sx, s16);
}

// A step's weights as vpdpwssd's int16 pairs, in the order of quantize_row_words's activations: wq = (q0, q2),
// (q1, q3), (q4, q6), (q5, q7) in each dword.
// From a 64-byte vector of nibbles (Q4_0's packing: a dword's 16-bit halves hold q0 q4 q1 q5 and q2 q6 q3 q7
// from their lowest nibble up): one shift and one mask a vector.
inline void nibbles_as_words(u8x64 v, u8x64 wq[4]) {
  const u8x64 low_nibble = set1_w(0x0F);
  wq[0] = and_b(v, low_nibble);
  wq[1] = and_b(shr16(v, 8), low_nibble);
  wq[2] = and_b(shr16(v, 4), low_nibble);
  wq[3] = shr16(v, 12);
}

// From the step's two byte vectors (vpdpbusd's operands: w0 steps 2s, w1 step 2s + 1): the even and the odd
// bytes of each dword as int16.
inline void bytes_as_words(u8x64 w0, u8x64 w1, u8x64 wq[4]) {
  const u8x64 low_byte = set1_w(0xFF);
  wq[0] = and_b(w0, low_byte);
  wq[1] = shr16(w0, 8);
  wq[2] = and_b(w1, low_byte);
  wq[3] = shr16(w1, 8);
}

// The byte products' pair sums (simd.h's pairs16, where PAIR_SUMS): a step's two byte products into an output's
// pairs, and every output's pairs (one a digit: int8's one, or hi then lo) added into its int32 sums and cleared
// (the caller bounds them within int16).
inline void add_step_pairs(pairs16& p, u8x64 w0, u8x64 w1, int32_t h0, int32_t h1) {
  p = dot_u7s8_pairs(dot_u7s8_pairs(p, w0, h0), w1, h1);
}
template <int M, int NGT, int P, int D>
inline void add_pairs_into(i32x16 (&qa)[M][NGT][P], pairs16 (&ps)[M][NGT][D]) {
  for (int i = 0; i < M; ++i)
    for (int g = 0; g < NGT; ++g)
      for (int u = 0; u < D; ++u) {
        qa[i][g][u == 0 ? 0 : P - 1] = add_pairs(qa[i][g][u == 0 ? 0 : P - 1], ps[i][g][u]);
        ps[i][g][u] = zero_pairs();
      }
}

// The rows a tile of a product's last, odd group takes at most where the tiles take two groups (AVX-512's 8 x 2: its
// last group in tiles of 4 rows and of the rest, so that no 5-8 row tile of one group is built).
constexpr int ODD_GROUP_ROWS = 4;

// An output's sum q a from its partial sums (exact): for two digits, (sum q hi << 8) + sum q lo; for one digit
// (int8 activations) or words, the parts' sum.
template <bool WORDS, int P>
inline i32x16 total(const i32x16 (&parts)[P]) {
  if constexpr (!WORDS && P == 2) return add_i(shl_i(parts[0], 8), parts[1]);
  i32x16 sum = parts[0];
  for (int u = 1; u < P; ++u) sum = add_i(sum, parts[u]);
  return sum;
}

// The quantized activations of m rows, as a tile reads them.
struct Activations {
  const int8_t* a;    // [m][2k] digits (or words: quantize_row_words)
  const float* dx;    // [m][k / 32] units
  const float* sx;    // [m][k / 32] unit * integer sum
  const int32_t* s16; // [m][k / 16] integer sums of half blocks (when asked for)
  int64_t blocks;     // k / 32

  Activations at(int64_t row) const {
    return {a + row * 2 * QK * blocks, dx + row * blocks, sx + row * blocks, s16 ? s16 + row * 2 * blocks : nullptr,
            blocks};
  }
};

// Runs y[m, :] = x[m, k] @ W^T where W's rows come in segments (one, or a packed layer's q, k and v
// stored in different formats), each packed in groups of 16 rows; segment s has rows[s] rows and
// writes the columns after the previous segments'. tile(s, rows, ng, acts, g0, y, ldy, n_valid)
// computes `rows` (at most mt) activation rows against groups g0 .. g0 + ng - 1 (ng at most
// ng_wide) of segment s into y (row stride ldy), of which the first n_valid outputs exist (first: its rows
// are the first of a pass over the weights, which the others then find in the cache). The
// activations are quantized once for every segment.
// words: the activations as quantize_row_words makes them; int8: as quantize_row_int8 (else quantize_row).
template <class Tile>
void drive(const float* x, int64_t m, int64_t k, float* y, int64_t ldy, const int64_t* rows, int segments,
           bool half_sums, int mt, int ng_wide, int threads, Tile tile, bool words = false, bool int8 = false) {
  const int64_t blocks = k / QK;
  std::vector<int8_t> a(m * 2 * k);
  std::vector<float> dx(m * blocks), sx(m * blocks);
  std::vector<int32_t> s16(half_sums ? m * 2 * blocks : 0);
  const Activations acts{a.data(), dx.data(), sx.data(), half_sums ? s16.data() : nullptr, blocks};
  // Groups per tile: for a few rows (decoding) one, so that each thread reads its weights as one
  // sequential stream, which the hardware prefetchers keep up with (two streams 5 KB apart measured
  // 1.2-1.45x slower from DRAM at 1-4 rows, on an AMD EPYC); for more rows, ng_wide for register reuse.
  const int ng_max = m <= 4 ? 1 : ng_wide;
  // A segment's tiles are ng_max groups each (its last one the groups left); each thread takes a range of the
  // tiles of all the segments in turn, walked from the segments' sizes. A list of the tiles, built each call and
  // read a tile at a time, made one decoding row's products from memory 1.04-1.05 times as slow on an Intel
  // Xeon (bench/kernels/one_row_pass.cpp).
  const auto groups_of = [&](int s) { return (rows[s] + G - 1) / G; };
  const auto tiles_of = [&](int s) { return (groups_of(s) + ng_max - 1) / ng_max; };
  int64_t tiles = 0;
  for (int s = 0; s < segments; ++s) tiles += tiles_of(s);
  // Activation rows per pass: as many as stay in a core's L2 beside the weights.
  const int64_t chunk = std::max<int64_t>(mt, (512 * 1024 / k) / mt * mt);
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < m; ++i) {
      const Activations row = acts.at(i);
      (int8 ? quantize_row_int8 : words ? quantize_row_words : quantize_row)(x + i * k, k, const_cast<int8_t*>(row.a), const_cast<float*>(row.dx),
                                                  const_cast<float*>(row.sx), const_cast<int32_t*>(row.s16));
    }
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t first = tiles * t / nt, last = tiles * (t + 1) / nt;
    for (int64_t m0 = 0; m0 < m; m0 += chunk) {
      const int64_t m1 = std::min(m, m0 + chunk);
      int64_t before = 0, col = 0;  // the tiles of the segments before s, and s's first column
      for (int s = 0; s < segments && before < last; before += tiles_of(s), col += rows[s], ++s) {
        const int64_t groups = groups_of(s), count = std::min(tiles_of(s), last - before);
        for (int64_t u = std::max<int64_t>(first - before, 0); u < count; ++u) {
          const int64_t g0 = u * ng_max;
          const int ng = (int)std::min<int64_t>(ng_max, groups - g0);
          for (int64_t i = m0; i < m1; i += mt) {
            const int r = (int)std::min<int64_t>(mt, m1 - i);
            tile(s, r, ng, acts.at(i), g0, y + i * ldy + col + g0 * G, ldy, rows[s] - g0 * G, i == m0);
          }
        }
      }
    }
  }
}

}  // namespace vnni
