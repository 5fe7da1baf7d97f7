// y[M, N] = x[M, K] @ W[N, K]^T for W in GGUF's block formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, MXFP4), with integer
// products (simd.h's dot_u8s8: 64 weight bytes by an activation dword's 4 bytes, added in fours into
// 16 int32 lanes; one vpdpbusd on AVX-512 VNNI). On AVX-512, 2.1 to 2.7 times the float32 kernel's rate
// (block_gemm.cpp).
//
// Activations: each block of 32 becomes 16-bit fixed point, x ~ dq * (256 * hi + lo) with
// dq = max|x| / (127 * 256) and hi, lo int8 digits (lo is the rounded remainder, |lo| <= 128, 128
// kept as 127). llama.cpp keeps only hi (8 bits, its Q8_1); on SmolLM2 that alone moves prompt
// logprobs by 0.07 on average, over the default's bound of 0.03, while two digits stay within
// about 1e-3 of the float32 reference. Up to 4 rows (decoding, where the weights' bytes bound the time),
// each digit is one pass of byte products over the same unpacked weights, and the two integer sums meet exactly
// (hi * 256 + lo) before one conversion to float. More rows of Q5_0, Q5_1, IQ4_NL and MXFP4 (all k-quants in
// kquant_gemm.cpp; see gemm below) take hi * 256 + lo as one int16 (it fits: vnni_common.h) and the weights
// widened to int16, one pass of dot_s16 (two int16 products a lane where the byte products take four int8
// ones: on AVX-512 vpdpwssd and vpdpbusd, as many instructions), whose exact sum is the same integer: the
// same bits, without the second sum per output and the shift and add per block, so 4 rows by 2 groups fit
// in AVX-512's registers where digits took 3. On Zen 4 vpdpbusd, vpdpwssd and the float multiplies and FMAs of
// the per-block fold share two pipes, which bounds both ways alike for the 4-bit formats (measured the
// same speed); where unpacking takes more instructions (Q5_0, Q5_1, k-quants' higher bits) words measured
// 5-20 % faster. Other instruction sets weigh the two forms differently (FORM below).
//
// Opted into (tm_vnni_gemm_int8, --activations int8): only hi, llama.cpp's Q8_0 activations (x ~ d * hi with
// d = max|x| / 127, hi = round(x / d), ties to even), one pass of byte products at every M on every backend:
// the digits' form with the second digit left out, half the products, at the precision cost above.
//
// Batch-invariant: the integer sums are exact, every float32 step is done per output in one fixed
// order (block after block along K), and the activations are quantized row by row, so a row's
// result never depends on the other rows, the tiling or the thread count.
//
// Layout (tm_vnni_pack): the weight rows go in groups of 16, so that one 64-byte vector holds 4
// consecutive weights of each of 16 rows and the 16 int32 lanes of the products are 16 outputs; one
// activation dword is broadcast to all lanes. Per group and block of 32 weights:
//   4-bit formats: 4 x 64 bytes; byte i of part s holds, for row i / 4 and weight i % 4, step 2s's
//                  weight in its low nibble and step 2s+1's in its high nibble (step j: weights
//                  4j..4j+3 of the block);
//   Q5_0, Q5_1:    their low four bits as Q4_0's, then their fifth bits in one 64-byte plane laid out
//                  as the nibbles are (byte i: bit j for step j), unpacked by a shift and an or_and,
//                  as kquant_gemm.cpp reads Q5_K's;
//   IQ4_NL, MXFP4: their 4-bit indices as Q4_0's nibbles, each turned into q = value + 128 by a lookup
//                  of the 16 values in the loop (IQ4_NL's levels; MXFP4's e2m1 values doubled,
//                  its e8m0 scale 2^(E - 127) halved into d = 2^(E - 128), exact in float16 for E - 128
//                  in [-24, 15]: trained weights' scales lie far inside; a block beyond it is refused);
//   Q8_0:          8 x 64 bytes, step j's weights as unsigned bytes (q + 128);
//   then the 16 rows' scales d as float16, and for Q4_1 and Q5_1 their 16 minimums m.
// Every format becomes  w = d * q + m  with unsigned q: Q4_0's m is -8d, Q5_0's -16d, Q8_0's, IQ4_NL's
// and MXFP4's -128d (exact in float32, computed in the kernel), so  sum_k w x  =  d * dx * sum q a  +  m * dx * sum a  with
// dx the activation block's scale (dq above). Packed, each format takes as many bytes as it does in the file.

#include "tm_abi.h"  // the block formats and this file's prototypes (generated from abi.py)
#include "vnni_common.h"  // the activations' fixed point and the tiles' driver, shared with kquant_gemm.cpp
#include "vnni_layout.h"  // the formats, unpacking and packing

namespace {

// Products of at most this many rows take the digits where the backend's byte products pay (FORM; see kquant_gemm.cpp).
constexpr int64_t MAX_DIGIT_ROWS = 4;

// Which form the integer products take, per backend: digits (two passes of byte products) or words (one of
// int16 products). The sums are the same integers, so the choice, like the tiles below, changes the speed only.
//   AVX-512: vpdpbusd and vpdpwssd are one instruction each: digits up to MAX_DIGIT_ROWS rows, past that words
//            in tiles of 8 rows (see words_past_digit_rows).
//   AVX2:    no byte product: dot_u7s8 takes three instructions a register and dot_u8s8 four, for the two passes
//            of digits, where dot_s16 takes two for the one pass of words: words at every M, measured on Zen 4
//            (in cache) 1.05-1.15 times (4 and 5 bits) and 2.2-2.6 times (Q8_0, IQ4_NL, MXFP4) as fast as digits
//            at 1-4 rows, Q4_0 1.2 and Q8_0 2.4 times at 17-64. But one row of 4- and 5-bit weights as digits whose
//            byte products stay int16 pairs (PAIR_SUMS: a vpmaddubsw and a vpaddw a product): Q4_0, Q4_1 and Q5_0
//            0.87-0.94 of the words' time (both cores, in cache; ONE_ROW_DIGITS in gemm).
//   NEON:    SDOT multiplies 16 bytes in one instruction where dot_s16 takes four for 8 words: digits at every M.
//   scalar:  words at every M, as AVX2: one pass of int16 products where digits take two (the compiler turns
//            dot_s16's loop into the baseline's pmaddwd); the suite's plain C++ server measured twice as fast.
enum class Form { DIGITS, WORDS_PAST_DIGIT_ROWS, WORDS };
#ifndef VNNI_FORM
#if defined(TM_ISA_AVX2) || defined(TM_ISA_SCALAR)
#define VNNI_FORM Form::WORDS
#elif defined(TM_ISA_NEON)
#define VNNI_FORM Form::DIGITS
#else
#define VNNI_FORM Form::WORDS_PAST_DIGIT_ROWS
#endif
#endif
constexpr Form FORM = VNNI_FORM;

// Register tiles: activation rows by groups of 16 outputs. AVX-512's words past MAX_DIGIT_ROWS take 8 rows by 2
// groups, more than its 32 registers hold: the compiler keeps the float sums in memory (a load and a store a
// block), and each unpacked weight serves 8 rows, not 4 (on an Intel Xeon, both cores, 16-512 rows: 0.83-0.96 of
// 4 x 2's time for Q4_0 and Q4_1, Q5_0 0.84-0.9, Q8_0 0.87-1.0; kquant_gemm.cpp's words measured alike). The other
// backends' 16 ymm or 32 q registers (two or four a vector) 2 rows by 1 group, measured the fastest of 1-4 rows by
// 1-2 groups on AVX2 (Zen 4) at 1-4 and 17-64 rows (NEON's speed is unmeasured).
#ifndef VNNI_MT  // (a dev script may try other tiles)
#define VNNI_MT (VECTOR_REGISTERS >= 32 ? 8 : 2)
#define VNNI_NG (VECTOR_REGISTERS >= 32 ? 2 : 1)
#define VNNI_MT_DIGITS (VECTOR_REGISTERS >= 32 ? 4 : 2)
#define VNNI_MT_WIDE 2  // (Form::DIGITS, NEON: digits at every M)
#endif
constexpr int MT = VNNI_MT;                // rows per tile as words past MAX_DIGIT_ROWS rows
constexpr int NG = VNNI_NG;                // groups per tile past MAX_DIGIT_ROWS rows (up to it: one)
constexpr int MT_DIGITS = VNNI_MT_DIGITS;  // rows per tile up to MAX_DIGIT_ROWS rows
constexpr int MT_WIDE = VNNI_MT_WIDE;      // rows per tile as digits past MAX_DIGIT_ROWS rows

// Step t's nibbles w with their fifth bits (bit t of each byte of plane) set above them: a 16-bit shift
// brings bit t to bit 4 within every byte, and or_and takes w | (shifted & 0x10).
inline u8x64 with_fifth_bit(u8x64 w, u8x64 plane, int t) {
  const u8x64 at4 = t < 4 ? shl16(plane, 4 - t) : t > 4 ? shr16(plane, t - 4) : plane;
  return or_and(w, at4, set1_b(0x10));
}

// Step 2s's and step 2s + 1's weights q (4 each of 16 rows) as unsigned bytes, from block p's parts.
template <int F>
inline void step_bytes(const uint8_t* p, int s, u8x64& w0, u8x64& w1) {
  if constexpr (byte_weights(F)) {
    w0 = load_b(p + (2 * s) * 64);
    w1 = load_b(p + (2 * s + 1) * 64);
  } else {
    const u8x64 v = load_b(p + s * 64), nibble = set1_b(0x0F);
    w0 = and_b(v, nibble);
    w1 = and_b(shr16(v, 4), nibble);
    if constexpr (fifth_bit(F)) {
      const u8x64 plane = load_b(p + 256);
      w0 = with_fifth_bit(w0, plane, 2 * s);
      w1 = with_fifth_bit(w1, plane, 2 * s + 1);
    }
    if constexpr (level_indices(F)) {
      w0 = lookup16(levels_of(F), w0);
      w1 = lookup16(levels_of(F), w1);
    }
  }
}

// Whether step_bytes's q are all below 128 (4 and 5 bits), which dot_u7s8 takes: else (Q8_0's q + 128, the
// levels + 128) dot_u8s8.
constexpr bool seven_bit(int fmt) { return !byte_weights(fmt) && !level_indices(fmt); }

// acc += q a for a step's four weights q (bytes) and one activation dword a (four int8).
template <int F>
inline i32x16 dot_bytes(i32x16 acc, u8x64 q, int32_t a) {
  if constexpr (seven_bit(F)) return dot_u7s8(acc, q, a);
  return dot_u8s8(acc, q, a);
}

// The same weights q0 .. q7 of each row as int16 pairs, dot_s16's operand (vnni_common.h's order).
template <int F>
inline void step_words(const uint8_t* p, int s, u8x64 wq[4]) {
  if constexpr (!byte_weights(F) && !fifth_bit(F) && !level_indices(F)) {
    vnni::nibbles_as_words(load_b(p + s * 64), wq);  // Q4_0, Q4_1: straight from the nibbles
  } else {
    u8x64 w0, w1;
    step_bytes<F>(p, s, w0, w1);
    vnni::bytes_as_words(w0, w1, wq);
  }
}

// y[i, 16g + l] for M activation rows (a: stride 2k bytes) and NGT groups starting at w. WORDS: the activations
// as one int16 each (quantize_row_words) and dot_s16; else as two int8 digits and dot_u7s8 / dot_u8s8: the same
// integer sums (see kquant_gemm.cpp's tile). INT8 (with WORDS false): the activations as one int8 digit
// (quantize_row_int8), one pass of the same byte products: dot_u7s8 for weights below 128 (on AVX2 vpmaddubsw,
// whose pair sums 2 * 127 * 128 cannot saturate int16, kept in 16 bits for several products: PAIRS), dot_u8s8
// for 8-bit q (Q8_0's signed weights + 128, the levels + 128: on AVX2 both operands widened to int16 and
// vpmaddwd, since u8 x s8 pairs reach 2 * 255 * 128 > 32767; on AVX-512 VNNI vpdpbusd, exact for every byte):
// exact int32 sums either way.
// Not inlined: inlined into the driver's loop, the one-row tile ran 1.15 times as long (Q8_0, in cache).
template <int F, int M, int NGT, bool WORDS, bool INT8 = false>
__attribute__((noinline)) void tile(const int8_t* a, const float* dx, const float* sx, int64_t k, const uint8_t* w, int64_t gstride,
                 float* y, int64_t ldy, int64_t n_valid) {
  // Partial sums per output as words: more where few outputs leave the products' latency exposed (AVX-512's
  // vpdpwssd; on AVX2 one part or these measured the same).
  static_assert(!(WORDS && INT8), "int8 activations are one digit");
  constexpr int PARTS = INT8 ? 1 : !WORDS ? 2 : M * NGT >= 4 ? 1 : M * NGT >= 2 ? 2 : 4;
  // Byte products where the backend keeps their sums as int16 pairs (simd.h's PAIR_SUMS): a 4-bit format's block of
  // 8 products in one pair sum a digit (at most 8 * 2 * 15 * 128 = 30720), a 5-bit one's 4 (31744), then added into qa.
  constexpr bool PAIRS = !WORDS && PAIR_SUMS && seven_bit(F);  // digits: a pair sum a digit
  constexpr int DIGITS = INT8 ? 1 : 2;
  constexpr int PAIR_STEPS = fifth_bit(F) ? 2 : 4;  // steps (two products each) a pair sum holds
  const int64_t blocks = k / QK;
  f32x16 acc[M][NGT];
  for (int i = 0; i < M; ++i)
    for (int g = 0; g < NGT; ++g) acc[i][g] = zero_f();
  for (int64_t b = 0; b < blocks; ++b) {
    i32x16 qa[M][NGT][PARTS];
    pairs16 ps[PAIRS ? M : 1][NGT][DIGITS];
    for (int i = 0; i < M; ++i)
      for (int g = 0; g < NGT; ++g) {
        for (int u = 0; u < PARTS; ++u) qa[i][g][u] = zero_i();
        if constexpr (PAIRS)
          for (int u = 0; u < DIGITS; ++u) ps[i][g][u] = zero_pairs();
      }
    const uint8_t* wb = w + b * group_block_bytes(F);
#pragma GCC unroll 4
    for (int s = 0; s < 4; ++s) {  // two steps of 4 weights each
      // The decoding tiles ask ahead for their weights (vnni_common.h), AVX2's words too: from memory at 2 and 4
      // rows mostly 1.1-1.45 times as fast with it (2 cases of 16 4 % slower); past 4 rows the same. Each step its
      // share of the block's lines (prefetch_share), and at one row too: on an Intel Xeon, from memory, Q4_0 1.23
      // times as fast, Q4_1 1.14, Q5_0 1.16, Q8_0 1.04 (the block's lines at its start, from 2 rows only before:
      // on an AMD EPYC one row measured no faster so, Q8_0 1.1 times slower); whatever a group's size (vnni_common.h).
      if constexpr (NGT == 1 && (!WORDS || FORM == Form::WORDS))
        vnni::prefetch_share<group_block_bytes(F), 4>(wb, s);
      if constexpr (WORDS) {
        u8x64 wq[NGT][4];
        for (int g = 0; g < NGT; ++g) step_words<F>(wb + g * gstride, s, wq[g]);
        for (int i = 0; i < M; ++i) {
          const int8_t* ai = a + i * 2 * k + b * 2 * QK + 16 * s;  // the 8 activations' words
          for (int u = 0; u < 4; ++u) {
            const int32_t au = dword_at(ai + 4 * u);
            for (int g = 0; g < NGT; ++g) qa[i][g][u % PARTS] = dot_s16(qa[i][g][u % PARTS], wq[g][u], au);
          }
        }
      } else {
        u8x64 w0[NGT], w1[NGT];
        for (int g = 0; g < NGT; ++g) step_bytes<F>(wb + g * gstride, s, w0[g], w1[g]);
        for (int i = 0; i < M; ++i) {
          const int8_t* ai = a + i * 2 * k + vnni::block_at(b, INT8) + 8 * s;
          const int32_t h0 = dword_at(ai), h1 = dword_at(ai + 4);
          for (int g = 0; g < NGT; ++g) {
            if constexpr (PAIRS) {
              vnni::add_step_pairs(ps[i][g][0], w0[g], w1[g], h0, h1);
            } else {
              qa[i][g][0] = dot_bytes<F>(qa[i][g][0], w0[g], h0);
              qa[i][g][0] = dot_bytes<F>(qa[i][g][0], w1[g], h1);
            }
          }
          if constexpr (!INT8) {
            const int32_t l0 = dword_at(ai + QK), l1 = dword_at(ai + QK + 4);
            for (int g = 0; g < NGT; ++g) {
              if constexpr (PAIRS) {
                vnni::add_step_pairs(ps[i][g][DIGITS - 1], w0[g], w1[g], l0, l1);
              } else {
                qa[i][g][PARTS - 1] = dot_bytes<F>(qa[i][g][PARTS - 1], w0[g], l0);
                qa[i][g][PARTS - 1] = dot_bytes<F>(qa[i][g][PARTS - 1], w1[g], l1);
              }
            }
          }
        }
        if constexpr (PAIRS)
          if ((s + 1) % PAIR_STEPS == 0) vnni::add_pairs_into(qa, ps);
      }
    }
    for (int g = 0; g < NGT; ++g) {
      const uint8_t* sc = wb + g * gstride + quant_bytes(F);
      const f32x16 d = load_half((const uint16_t*)sc);
      const f32x16 m = stored_min(F) ? load_half((const uint16_t*)(sc + 2 * G)) : mul(d, set1(implied_min(F)));
      for (int i = 0; i < M; ++i) {
        const f32x16 scale = mul(d, set1(dx[i * blocks + b]));
        const i32x16 isum = total<WORDS>(qa[i][g]);  // exact
        acc[i][g] = fmadd(to_float(isum), scale, acc[i][g]);
        acc[i][g] = fmadd(m, set1(sx[i * blocks + b]), acc[i][g]);
      }
    }
  }
  for (int g = 0; g < NGT; ++g) {
    const int64_t left = n_valid - g * G;
    if (left <= 0) break;
    const lanes mask = first_lanes(left);
    for (int i = 0; i < M; ++i) store_masked(y + i * ldy + g * G, mask, acc[i][g]);
  }
}

// tile<F, M, ng, WORDS, INT8> for ng = NGT, NGT - 1, ..., 1; a product's last, odd group in tiles of at most
// vnni::ODD_GROUP_ROWS rows (two where M is more): fewer tiles to build, for a group that is one of thousands.
template <int F, int M, bool WORDS, int NGT, bool INT8 = false>
inline void tile_groups(int ng, const int8_t* a, const float* dx, const float* sx, int64_t k, const uint8_t* w,
                        int64_t gstride, float* y, int64_t ldy, int64_t n_valid) {
  if constexpr (NGT > 1)
    if (ng < NGT) {
      constexpr int HALF = M > vnni::ODD_GROUP_ROWS ? vnni::ODD_GROUP_ROWS : M;
      tile_groups<F, HALF, WORDS, NGT - 1, INT8>(ng, a, dx, sx, k, w, gstride, y, ldy, n_valid);
      if constexpr (M > HALF) {
        const int64_t blocks = k / QK;
        tile_groups<F, M - HALF, WORDS, NGT - 1, INT8>(ng, a + HALF * 2 * k, dx + HALF * blocks, sx + HALF * blocks, k,
                                                       w, gstride, y + HALF * ldy, ldy, n_valid);
      }
      return;
    }
  tile<F, M, NGT, WORDS, INT8>(a, dx, sx, k, w, gstride, y, ldy, n_valid);
}

// tile_groups<F, rows, WORDS, NGT, INT8> for rows = M, M - 1, ..., 1.
template <int F, bool WORDS, int M, int NGT, bool INT8 = false>
inline void tile_rows(int rows, int ng, const int8_t* a, const float* dx, const float* sx, int64_t k, const uint8_t* w,
                      int64_t gstride, float* y, int64_t ldy, int64_t n_valid) {
  if constexpr (M > 1)
    if (rows < M) return tile_rows<F, WORDS, M - 1, NGT, INT8>(rows, ng, a, dx, sx, k, w, gstride, y, ldy, n_valid);
  tile_groups<F, M, WORDS, NGT, INT8>(ng, a, dx, sx, k, w, gstride, y, ldy, n_valid);
}

// With Form::WORDS_PAST_DIGIT_ROWS (AVX-512): words past MAX_DIGIT_ROWS for every format. In 4 x 2 tiles, Q8_0,
// Q4_0 and Q4_1 (whose bytes take no unpacking as digits, or a mask and a shift) measured the same to 1-2 % slower as
// words, and kept the digits in MT_WIDE-row tiles; in 8 x 2 tiles, words halve the unpacking a product and are the
// faster (see MT). Q5_0, Q5_1, IQ4_NL and MXFP4 took words before too.
constexpr bool words_past_digit_rows(int) { return FORM == Form::WORDS || FORM == Form::WORDS_PAST_DIGIT_ROWS; }

template <int F>
void gemm(const float* x, int64_t m, int64_t k, const uint8_t* w, int64_t n, float* y, int threads) {
  const int64_t gstride = (k / QK) * group_block_bytes(F);
  constexpr bool WIDE_WORDS = words_past_digit_rows(F), FEW_WORDS = FORM == Form::WORDS;
  // AVX2's one row of 4- and 5-bit weights as digits, each digit's byte products as int16 pairs (PAIR_SUMS): fewer
  // instructions than the words' unpacking and vpmaddwd + vpaddd (as kquant_gemm.cpp's; at 2-4 rows words stay).
  constexpr bool ONE_ROW_DIGITS = FEW_WORDS && PAIR_SUMS && seven_bit(F);
  const bool wide = m > MAX_DIGIT_ROWS, words = wide ? WIDE_WORDS : FEW_WORDS && !(ONE_ROW_DIGITS && m == 1);
  constexpr int WIDE_ROWS = WIDE_WORDS ? MT : MT_WIDE;
  const int mt = wide ? WIDE_ROWS : MT_DIGITS;
  // Only the tiles a format uses are instantiated: up to MAX_DIGIT_ROWS rows one group a tile (the driver's
  // decoding tiles), past that up to NG.
  vnni::drive(x, m, k, y, n, &n, 1, false, mt, NG, threads,
              [&](int, int rows, int ng, const vnni::Activations& r, int64_t g0, float* yt, int64_t ldy,
                  int64_t n_valid, bool) {
                const uint8_t* wg = w + g0 * gstride;
                if (wide)
                  tile_rows<F, WIDE_WORDS, WIDE_ROWS, NG>(rows, ng, r.a, r.dx, r.sx, k, wg, gstride, yt, ldy, n_valid);
                else if (ONE_ROW_DIGITS && !words) {
                  if constexpr (ONE_ROW_DIGITS)
                    tile_rows<F, false, 1, 1>(rows, ng, r.a, r.dx, r.sx, k, wg, gstride, yt, ldy, n_valid);
                } else
                  tile_rows<F, FEW_WORDS, MT_DIGITS, 1>(rows, ng, r.a, r.dx, r.sx, k, wg, gstride, yt, ldy, n_valid);
              },
              words);
}

// The product with 8-bit activations (quantize_row_int8): one digit's byte products at every M and on every
// backend (no words form: an int8 activation pairs with one byte weight as it comes), up to MAX_DIGIT_ROWS rows
// in the decoding tiles (one group each), past that in the words' MT x NG tiles (one partial sum an output, as
// words take).
template <int F>
void gemm_int8(const float* x, int64_t m, int64_t k, const uint8_t* w, int64_t n, float* y, int threads) {
  const int64_t gstride = (k / QK) * group_block_bytes(F);
  const bool wide = m > MAX_DIGIT_ROWS;
  vnni::drive(x, m, k, y, n, &n, 1, false, wide ? MT : MT_DIGITS, NG, threads,
              [&](int, int rows, int ng, const vnni::Activations& r, int64_t g0, float* yt, int64_t ldy,
                  int64_t n_valid, bool) {
                const uint8_t* wg = w + g0 * gstride;
                if (wide)
                  tile_rows<F, false, MT, NG, true>(rows, ng, r.a, r.dx, r.sx, k, wg, gstride, yt, ldy, n_valid);
                else
                  tile_rows<F, false, MT_DIGITS, 1, true>(rows, ng, r.a, r.dx, r.sx, k, wg, gstride, yt, ldy, n_valid);
              },
              false, true);
}

}  // namespace

extern "C" {

// Bytes tm_vnni_pack writes for n rows of k weights in format fmt (0 for an unknown format).
int64_t tm_vnni_packed_bytes(int fmt, int64_t n, int64_t k) {
  if (!source_block_bytes(fmt)) return 0;
  return (n + G - 1) / G * (k / QK) * group_block_bytes(fmt);
}

// Returns 0, -1 for an unknown format, -2 for k not a multiple of 32, -3 for an MXFP4 block whose scale
// float16 cannot hold (2^(E - 128) outside 2^-24 .. 2^15).
int tm_vnni_pack(int fmt, const uint8_t* src, int64_t n, int64_t k, uint8_t* out) {
  if (!source_block_bytes(fmt)) return -1;
  if (k % QK) return -2;
  return pack(fmt, src, n, k, out);
}

int tm_vnni_gemm(int fmt, const float* x, int64_t m, int64_t k, const uint8_t* w, int64_t n, float* y, int threads) {
  if (!source_block_bytes(fmt)) return -1;
  if (k % QK) return -2;
  with_vnni_format(fmt, 0, [&](auto F) {
    gemm<decltype(F)::value>(x, m, k, w, n, y, threads);
    return 0;
  });
  return 0;
}

// tm_vnni_gemm with the activations as 8-bit integers per block of 32 (tm_vnni_quantize_int8), the opt-in
// faster, less precise mode: one byte product per weight. The same return codes.
int tm_vnni_gemm_int8(int fmt, const float* x, int64_t m, int64_t k, const uint8_t* w, int64_t n, float* y,
                      int threads) {
  if (!source_block_bytes(fmt)) return -1;
  if (k % QK) return -2;
  with_vnni_format(fmt, 0, [&](auto F) {
    gemm_int8<decltype(F)::value>(x, m, k, w, n, y, threads);
    return 0;
  });
  return 0;
}

// The packed weights [n, k] as float32: d * q + m, exactly gguf's dequantized values.
int tm_vnni_dequantize(int fmt, const uint8_t* w, int64_t n, int64_t k, float* out) {
  if (!source_block_bytes(fmt)) return -1;
  if (k % QK) return -2;
  const int64_t blocks = k / QK, gbb = group_block_bytes(fmt);
  for (int64_t r = 0; r < n; ++r) {
    const int64_t g = r / G, row = r % G;
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* src = w + (g * blocks + b) * gbb;
      const float d = half_to_float(half_bits(src + quant_bytes(fmt) + row * 2));
      const float m =
          stored_min(fmt) ? half_to_float(half_bits(src + quant_bytes(fmt) + G * 2 + row * 2)) : implied_min(fmt) * d;
      for (int j = 0; j < QK; ++j) {
        const int step = j / 4, i = (int)row * 4 + j % 4;
        int q = byte_weights(fmt) ? src[step * 64 + i] : (src[(step / 2) * 64 + i] >> (step % 2 ? 4 : 0)) & 0x0F;
        if (fifth_bit(fmt)) q |= ((src[256 + i] >> step) & 1) << 4;
        if (level_indices(fmt)) q = levels_of(fmt)[q];
        out[r * k + b * QK + j] = d * (float)q + m;
      }
    }
  }
  return 0;
}

// x as the product sees it: q [m, k] = 256 * hi + lo, and the unit dq [m, k / 32] of each block.
int tm_vnni_quantize(const float* x, int64_t m, int64_t k, int16_t* q, float* dq) {
  if (k % QK) return -2;
  const int64_t blocks = k / QK;
  std::vector<int8_t> a(2 * k);
  std::vector<float> sx(blocks);
  for (int64_t i = 0; i < m; ++i) {
    quantize_row(x + i * k, k, a.data(), dq + i * blocks, sx.data(), nullptr);
    for (int64_t b = 0; b < blocks; ++b)
      for (int j = 0; j < QK; ++j) q[i * k + b * QK + j] = (int16_t)(a[b * 2 * QK + j] * 256 + a[b * 2 * QK + QK + j]);
  }
  return 0;
}

// x as tm_vnni_gemm_int8 sees it: q [m, k] = round(x / d) (int8, ties to even) and each block's d = max|x| / 127
// [m, k / 32].
int tm_vnni_quantize_int8(const float* x, int64_t m, int64_t k, int8_t* q, float* d) {
  if (k % QK) return -2;
  const int64_t blocks = k / QK;
  std::vector<int8_t> a(2 * k);
  std::vector<float> sx(blocks);
  for (int64_t i = 0; i < m; ++i) {
    vnni::quantize_row_int8(x + i * k, k, a.data(), d + i * blocks, sx.data(), nullptr);
    memcpy(q + i * k, a.data(), k);  // the row's blocks one after another (vnni::block_at)
  }
  return 0;
}
}
