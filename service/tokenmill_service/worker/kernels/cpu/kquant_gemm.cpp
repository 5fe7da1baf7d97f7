// y[M, N] = x[M, K] @ W[N, K]^T for W in llama.cpp's k-quants (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, and IQ4_XS:
// super-blocks of 256 weights), with the integer products of vnni_gemm.cpp: the activations as 16-bit fixed point
// per block of 32 (vnni_common.h), weights as unsigned integers, products of bytes (dot_u7s8 / dot_u8s8) or of
// int16 pairs (dot_s16; which for how many rows depends on the backend: MAX_DIGIT_ROWS), exact int32 sums.
// Written in simd.h's ops: the same bits on every CPU. Opted into (tm_kquant_gemm_int8, --activations int8): the
// activations as 8-bit integers per block (vnni_gemm.cpp), one pass of byte products at every M.
//
// What a weight is (exactly as gguf.quants dequantizes it; every product below is exact in float32):
//   Q4_K, Q5_K: 8 sub-blocks of 32, each with a 6-bit scale sc and minimum m; the super-block has
//               float16 d and dmin;  w = (d * sc) * q - dmin * m,  q in 0..15 (Q5_K: 0..31, a fifth bit).
//   Q6_K:       16 sub-blocks of 16, each with an int8 scale sc; float16 d;  w = (d * sc) * (q - 32),
//               q in 0..63.
//   Q2_K:       16 sub-blocks of 16, each with a 4-bit scale sc and minimum m; float16 d and dmin;
//               w = (d * sc) * q - dmin * m,  q in 0..3.
//   Q3_K:       16 sub-blocks of 16, each with a 6-bit scale ls; float16 d;  w = (d * (ls - 32)) * (q - 4),
//               q in 0..7 (two low bits and the hmask bit above them; a clear bit is gguf's -4): served
//               as Q6_K is, with sc = ls - 32 and an offset of 4 for 32.
//   IQ4_XS:     8 sub-blocks of 32, each with a 6-bit scale ls; float16 d;  w = (d * (ls - 32)) * level,
//               level one of IQ4_NL's 16 values in -127..113: served as Q6_K is, with q = level + 128
//               (looked up from its 4-bit index in the loop) and an offset of 128 for 32, the sub-block's
//               scale on both its halves.
// So per activation block b of 32 (unit dx, integer values a, sx = dx * sum a):
//   Q4_K, Q5_K: sum w x = (d sc) dx * sum q a  -  (dmin m) * sx           (one sub-block = one block)
//   Q2_K:       per half block h:  (d sc_h) dx * sum q a  -  (dmin m_h) * (dx * sum_h a)
//   Q6_K:       per half block h:  (d sc_h) dx * (sum q a - 32 * sum_h a)   (the integer part exact;
//               Q3_K: - 4 * sum_h a, exact; IQ4_XS: - 128 * sum_h a, whose difference can exceed 2^24 and
//               rounds once to float32)
//
// Batch-invariant: the integer sums are exact, every float32 step is done per output in one fixed
// order (block after block along K), and the activations are quantized row by row, so a row's
// result never depends on the other rows, the tiling or the thread count.
//
// Layout (tm_kquant_pack): rows in groups of 16 (a product's 16 int32 lanes are 16 outputs);
// per group and super-block, for each of its 8 blocks of 32:
//   Q4_K, Q5_K, Q6_K, IQ4_XS: the low four bits of every weight as vnni_gemm.cpp packs Q4_0 (4 x 64 bytes:
//               byte i of part s holds, for row i / 4 and weight i % 4, step 2s's weight in its low
//               nibble and step 2s+1's in its high nibble; step j: weights 4j..4j+3); Q5_K and Q6_K
//               then, right after the block's nibbles, their higher bits (q >> 4: one bit, two bits)
//               in 64-byte planes laid out as the nibbles are, byte i for the same row and weight of
//               each step: Q5_K one plane, bit t for step t; Q6_K two, plane p's bits 2u, 2u + 1 for
//               step 4p + u. A step's higher bits are one shift and one bitwise select (or_and)
//               into its nibbles, and a thread reads its weights as one stream. Measured on an AMD
//               EPYC, one decoding row: Q5_K as fast a byte as Q4_K, 2.7 times the speed of its bits as
//               64-bit masks kept after all 8 blocks' nibbles (a second stream 2 KB ahead); Q6_K 1.2-1.3
//               times its speed a byte a weight, and the file's size instead of 1.31 times it;
//   IQ4_XS:     its 4-bit indices as the others' nibbles, each turned into level + 128 by one byte
//               lookup (lookup16 over the 16 levels) in the loop;
//   Q3_K:       the low two bits of every weight in two 64-byte planes (byte i as the nibbles', plane p's
//               bits 2u, 2u + 1 for step 4p + u), then its hmask bit in one plane as Q5_K's fifth bit
//               (bit t for step t): 192 bytes, 3 bits a weight. A step's q is one shift and a mask for
//               the low bits and one shift and an or_and select for the high bit, in one stream;
//   Q2_K:       its two bits in two 64-byte planes as Q3_K's low bits, and nothing above them: 128 bytes;
// then the scales:
//   Q4_K, Q5_K: d[16] and dmin[16] as float16, then the 6-bit sc and m as the file's 12 bytes a row: [8][16] bytes
//               of sc << 2 | (m & 3), a block each, and [4][16] of m >> 2, two blocks' a byte (2304 / 2816 bytes)
//   Q2_K:       d[16] and dmin[16] as float16, [16][16] bytes of sc | m << 4, a half block's each (1344 bytes)
//   Q6_K, Q3_K: d[16] as float16, sc[16][16] as int8   (Q6_K 3360, Q3_K 1824 bytes)
//   IQ4_XS:     d[16] as float16, sc[8][16] as int8, a block's (2208 bytes)
// A layer whose row ranges are stored in different k-quants (TM_KQUANT_MIXED: a packed q/k/v with v in
// Q6_K) is its segments one after another, each packed as above, behind a header (abi.py) saying
// each one's format, rows and offset; one call quantizes the activations once for all of them.
// Q4_K, Q5_K, Q6_K and Q2_K take the file's bytes (4.5, 5.5, 6.56 and 2.63 bits a weight), IQ4_XS 4.31 against
// 4.25 and Q3_K 3.56 against 3.44 (their 6-bit scales as bytes).

#include "tm_abi.h"       // the block formats and this file's prototypes (generated from abi.py)
#include "vnni_common.h"  // the activations' fixed point and the tiles' driver
#include "kquant_layout.h"  // the formats, unpacking and packing
#include "kquant_tiling.h"  // the register tiles and the activations' form for each row count

namespace {

// An output's partial sums at the start of a block (or half block h): zero, or for the formats with an offset
// -offset * sum_h a (s16[h]) in the units of total (the lo digits' sum for digits).
template <int F, bool WORDS, int P>
inline void start_sums(i32x16 (&parts)[P], const int32_t* s16, int64_t h) {
  for (int u = 0; u < P; ++u) parts[u] = zero_i();
  if constexpr (signed_scales(F)) parts[WORDS ? 0 : P - 1] = set1_i(-q_offset(F) * s16[h]);  // int8: one part
}

// A byte product for format F's weights: below 128 but for IQ4_XS's levels + 128 (some backends have a faster
// product for those: AVX2's vpmaddubsw cannot saturate there, NEON's SDOT takes them as signed bytes).
template <int F>
inline i32x16 dot_q(i32x16 acc, u8x64 q, int32_t a4) {
  if constexpr (level_indices(F)) return dot_u8s8(acc, q, a4);
  else return dot_u7s8(acc, q, a4);
}

// y[i, 16g + l] for M activation rows and NGT groups starting at w. WORDS: the activations as one int16 each
// (quantize_row_words) and dot_s16, one product a pair of weights; else as two int8 digits (quantize_row) and
// byte products (dot_q), two (one a digit) a quad of weights. The integer sums are the same, so are the outputs.
// Words take no second sum per output nor the digits' (hi << 8) + lo each block, so more rows fit in the
// registers (MT), but two more shifts or masks a quad of weights: on AVX-512 the digits for the few rows of
// decoding (which form each backend takes: MAX_DIGIT_ROWS).
// What bounds the words on Zen 4 (AVX-512) is the float fold of each block: its multiply and FMAs share
// vpdpwssd's two pipes (3 of them a block per output against 16 products; Q4_K measured 1.22 times as fast
// with them taken out, Q6_K 1.17), and they must stay, one rounding at a time in this order, for the outputs' bits.
// INT8 (with WORDS false): the activations as one int8 digit (quantize_row_int8), the digits' byte products with
// the lo pass left out, one partial sum per output. Exact as the digits' are: dot_q's weights are below 128 but
// for IQ4_XS's levels + 128, which take dot_u8s8 (on AVX2 both operands widened to int16 and vpmaddwd, since
// u8 x s8 pairs reach 2 * 241 * 128 > 32767; below 128 vpmaddubsw's pairs stay within 2 * 127 * 128), and the
// offsets' -offset * sum a start the one sum (s16: the half blocks' sums of the int8 values).
// Not inlined (as vnni_gemm.cpp's): inlined into the driver's loop, the two-row Q6_K tile measured 1.7 times as long.
// AHEAD: the weights (weights_ahead) and scales (scales_ahead) read from `unpacked` (unpacked_ahead), not unpacked
// here; its own build of the tile, so that the others are the same code as without it.
template <int F, int M, int NGT, bool WORDS, bool INT8 = false, bool AHEAD = false>
__attribute__((noinline)) void tile(const Activations& act, int64_t k, const uint8_t* w, int64_t gstride, float* y, int64_t ldy,
                 int64_t n_valid, bool first, const uint8_t* unpacked) {
  // Partial sums per output: digits hi and lo; words enough independent chains of dot_s16 in flight (WORD_CHAINS).
  static_assert(!(WORDS && INT8), "int8 activations are one digit");
  constexpr int PARTS = INT8 ? 1 : !WORDS ? 2 : M * NGT >= 2 * WORD_CHAINS ? 1 : M * NGT >= WORD_CHAINS ? 2 : 4;
  const int64_t blocks = k / QK;
  f32x16 acc[M][NGT];
  // The block's sums and a pass's weights, declared here rather than in the loops that use them: so declared,
  // GCC 12.2 at -O3 miscompiled the scalar build's Q2_K tile of 4 rows x 2 groups (its first group's sums
  // started from garbage; right with -fstack-reuse=none: its sharing of stack slots between scopes).
  i32x16 qa[M][NGT][PARTS];
  u8x64 wq[NGT][4], w0[NGT], w1[NGT];
  // int8 where the backend keeps byte products' sums as int16 pairs (PAIR_SUMS): added into qa every PAIR_STEPS.
  // Digits (DIGIT_PAIRS) keep a pair sum for each digit.
  constexpr bool PAIRS = (INT8 || DIGIT_PAIRS) && !WORDS && PAIR_SUMS && !level_indices(F);
  constexpr int DIGITS = INT8 ? 1 : 2;
  pairs16 ps[PAIRS ? M : 1][NGT][DIGITS];
  if constexpr (PAIRS)
    for (int i = 0; i < M; ++i)
      for (int g = 0; g < NGT; ++g)
        for (int u = 0; u < DIGITS; ++u) ps[i][g][u] = zero_pairs();
  for (int i = 0; i < M; ++i)
    for (int g = 0; g < NGT; ++g) acc[i][g] = zero_f();
  for (int64_t sb = 0; sb < k / QK_K; ++sb) {
    f32x16 d[NGT], dmin[NGT];
    i32x16 pair_high[NGT];  // six-bit scales: a pair of blocks' high bits of the minimums
    for (int g = 0; g < NGT; ++g) {
      const Packed p(F, w, gstride, g, sb);
      d[g] = load_half((const uint16_t*)p.scales);
      dmin[g] = signed_scales(F) ? zero_f() : load_half((const uint16_t*)(p.scales + 2 * G));
    }
    for (int64_t j = 0; j < SUBS; ++j) {
      const int64_t b = sb * SUBS + j;
      // sum q a of the block (or half block) so far, exact, in PARTS sums per output; for the formats with an
      // offset, sum (q - offset) a: the sums start from -offset * sum a (in the units of total: the lo digits'
      // sum for digits), which takes no subtraction per half block.
      for (int i = 0; i < M; ++i)
        for (int g = 0; g < NGT; ++g) start_sums<F, WORDS>(qa[i][g], act.s16, i * 2 * blocks + 2 * b);
#pragma GCC unroll 4
      for (int s = 0; s < 4; ++s) {  // two steps of 4 weights each
        // The tile first to read its groups (the driver's first rows; the others find them in the cache) asks
        // ahead for them, group by group: for decoding (one group, the thread's weights one stream; AVX2's words
        // without it up to 1.5 times as long from memory), and for more rows (both cores, from memory, int8 at 16
        // rows: Q4_K and Q6_K 0.8-0.9 of the time; asking in every tile made 64 rows 1.04-1.07 times as slow). A
        // step's share of the super-block's lines (vnni_common.h): all of them at its start (37-53 prefetches) held
        // the loads behind them; an eighth at each block measured 1.09-1.14 times as fast on an Intel Xeon, one row
        // from memory, a step's share 1.07-1.11 times as fast again (AVX2's 1.13-1.15; 1.03-1.08 at 2-4 and 64 rows).
        // Whatever a group's size: where it spans less than the distance, the lines ahead are the next groups'.
        // (The decoding tiles: the form of the fewest rows, and every form where a backend's tiles take one group.)
        if constexpr (NGT > 1 || INT8 || WORDS == (MAX_DIGIT_ROWS == 0) || NG == 1)
          if (first && !(AHEAD && weights_ahead(F)))
            for (int g = 0; g < NGT; ++g)
              vnni::prefetch_share<group_super_bytes(F), 4 * SUBS>(Packed(F, w, gstride, g, sb).quants, 4 * j + s);
        if constexpr (WORDS) {
          for (int g = 0; g < NGT; ++g) {
            if constexpr (AHEAD && weights_ahead(F))
              for (int u = 0; u < 4; ++u) wq[g][u] = load_b(unpacked + unpacked_step<true>(k, g, sb, j, s) + 64 * u);
            else
              step_words<F>(Packed(F, w, gstride, g, sb).quants + j * block_quant_bytes(F), s, wq[g]);
          }
          for (int i = 0; i < M; ++i) {
            const int8_t* ai = act.a + i * 2 * k + b * 2 * QK + 16 * s;  // the 8 activations' words
            for (int u = 0; u < 4; ++u) {
              const int32_t au = dword_at(ai + 4 * u);
              for (int g = 0; g < NGT; ++g) qa[i][g][u % PARTS] = dot_s16(qa[i][g][u % PARTS], wq[g][u], au);
            }
          }
        } else {
          for (int g = 0; g < NGT; ++g) {
            if constexpr (AHEAD && weights_ahead(F)) {
              w0[g] = load_b(unpacked + unpacked_step<false>(k, g, sb, j, s));
              w1[g] = load_b(unpacked + unpacked_step<false>(k, g, sb, j, s) + 64);
            } else {
              step_bytes<F>(Packed(F, w, gstride, g, sb).quants + j * block_quant_bytes(F), s, w0[g], w1[g]);
            }
          }
          for (int i = 0; i < M; ++i) {
            const int8_t* ai = act.a + i * 2 * k + vnni::block_at(b, INT8) + 8 * s;
            const int32_t h0 = dword_at(ai), h1 = dword_at(ai + 4);
            for (int g = 0; g < NGT; ++g) {
              if constexpr (PAIRS) {
                vnni::add_step_pairs(ps[i][g][0], w0[g], w1[g], h0, h1);
              } else {
                qa[i][g][0] = dot_q<F>(qa[i][g][0], w0[g], h0);
                qa[i][g][0] = dot_q<F>(qa[i][g][0], w1[g], h1);
              }
            }
            if constexpr (!INT8) {
              const int32_t l0 = dword_at(ai + QK), l1 = dword_at(ai + QK + 4);
              for (int g = 0; g < NGT; ++g) {
                if constexpr (PAIRS) {
                  vnni::add_step_pairs(ps[i][g][DIGITS - 1], w0[g], w1[g], l0, l1);
                } else {
                  qa[i][g][PARTS - 1] = dot_q<F>(qa[i][g][PARTS - 1], w0[g], l0);
                  qa[i][g][PARTS - 1] = dot_q<F>(qa[i][g][PARTS - 1], w1[g], l1);
                }
              }
            }
          }
          if constexpr (PAIRS)
            if ((s + 1) % pair_steps(F) == 0) vnni::add_pairs_into(qa, ps);
        }
        if constexpr (F == Q2_K) {
          if (s % 2 == 0) continue;
          // The end of a half block (16 weights, one scale and minimum): fold it in and start the next.
          for (int g = 0; g < NGT; ++g) {
            f32x16 de, dm;  // d sc and dmin m, exact: from the buffer ahead, or unpacked here
            if constexpr (AHEAD) {
              de = load(ahead_scales<F, NGT, WORDS>(unpacked, k, g, b) + (s / 2) * 2 * G);
              dm = load(ahead_scales<F, NGT, WORDS>(unpacked, k, g, b) + (s / 2) * 2 * G + G);
            } else {
              const uint8_t* scales = Packed(F, w, gstride, g, sb).scales;
              const i32x16 both = load_u8_i(scales + q2_scale_at(2 * j + s / 2));  // sc | m << 4
              de = mul(d[g], to_float(and_i(both, set1_i(15))));
              dm = mul(dmin[g], to_float(shr_i(both, 4)));
            }
            for (int i = 0; i < M; ++i) {
              const float dx = act.dx[i * blocks + b];
              acc[i][g] = fmadd(to_float(total<WORDS>(qa[i][g])), mul(de, set1(dx)), acc[i][g]);
              const float sxh = dx * (float)act.s16[i * 2 * blocks + 2 * b + s / 2];
              acc[i][g] = fnmadd(dm, set1(sxh), acc[i][g]);
              for (int u = 0; u < PARTS; ++u) qa[i][g][u] = zero_i();
            }
          }
        }
        if constexpr (signed_scales(F)) {
          if (s % 2 == 0) continue;
          // The end of a half block (16 weights, one scale): fold it in and start the next.
          const int64_t half = 2 * j + s / 2;
          for (int g = 0; g < NGT; ++g) {
            const Packed p(F, w, gstride, g, sb);
            const f32x16 de = AHEAD ? load(ahead_scales<F, NGT, WORDS>(unpacked, k, g, b) + (s / 2) * G)  // d sc, exact
                                    : mul(d[g], bytes_as_floats(p.scales + signed_scale_at(F, half), true));
            for (int i = 0; i < M; ++i) {
              const f32x16 scale = mul(de, set1(act.dx[i * blocks + b]));
              acc[i][g] = fmadd(to_float(total<WORDS>(qa[i][g])), scale, acc[i][g]);  // centred
              if (s == 1) start_sums<F, WORDS>(qa[i][g], act.s16, i * 2 * blocks + 2 * b + 1);
            }
          }
        }
      }
      if constexpr (!half_scales(F)) {
        for (int g = 0; g < NGT; ++g) {
          f32x16 de, dm;  // d sc and dmin m, exact: from the buffer ahead (its ng groups are NGT), or unpacked here
          if constexpr (AHEAD) {
            de = load(ahead_scales<F, NGT, WORDS>(unpacked, k, g, b));
            dm = load(ahead_scales<F, NGT, WORDS>(unpacked, k, g, b) + G);
          } else {
            const uint8_t* scales = Packed(F, w, gstride, g, sb).scales;
            if (j % 2 == 0) pair_high[g] = load_u8_i(scales + six_bit_high(j));
            f32x16 sc, m;
            six_bit_scales_of(scales, j, pair_high[g], sc, m);
            de = mul(d[g], sc), dm = mul(dmin[g], m);
          }
          for (int i = 0; i < M; ++i) {
            const f32x16 scale = mul(de, set1(act.dx[i * blocks + b]));
            acc[i][g] = fmadd(to_float(total<WORDS>(qa[i][g])), scale, acc[i][g]);
            acc[i][g] = fnmadd(dm, set1(act.sx[i * blocks + b]), acc[i][g]);
          }
        }
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
template <int F, int M, bool WORDS, bool INT8, int NGT = NG>
inline void tile_groups(int ng, const Activations& act, int64_t k, const uint8_t* w, int64_t gstride, float* y,
                        int64_t ldy, int64_t n_valid, bool first, const uint8_t* unpacked) {
  if constexpr (NGT > 1)
    if (ng < NGT) {
      constexpr int HALF = M > vnni::ODD_GROUP_ROWS ? vnni::ODD_GROUP_ROWS : M;
      tile_groups<F, HALF, WORDS, INT8, NGT - 1>(ng, act, k, w, gstride, y, ldy, n_valid, first, unpacked);
      if constexpr (M > HALF)
        tile_groups<F, M - HALF, WORDS, INT8, NGT - 1>(ng, act.at(HALF), k, w, gstride, y + HALF * ldy, ldy, n_valid,
                                                       false, unpacked);
      return;
    }
  if constexpr (UNPACK_TILES > 0 && (weights_ahead(F) || scales_ahead(F)))
    if (unpacked) return tile<F, M, NGT, WORDS, INT8, true>(act, k, w, gstride, y, ldy, n_valid, first, unpacked);
  tile<F, M, NGT, WORDS, INT8>(act, k, w, gstride, y, ldy, n_valid, first, nullptr);
}

// tile_groups<F, rows, WORDS, INT8, NGT> for rows = M, M - 1, ..., 1.
template <int F, bool WORDS, bool INT8, int M, int NGT>
inline void tile_rows(int rows, int ng, const Activations& act, int64_t k, const uint8_t* w, int64_t gstride, float* y,
                      int64_t ldy, int64_t n_valid, bool first, const uint8_t* unpacked) {
  if constexpr (M > 1)
    if (rows < M)
      return tile_rows<F, WORDS, INT8, M - 1, NGT>(rows, ng, act, k, w, gstride, y, ldy, n_valid, first, unpacked);
  tile_groups<F, M, WORDS, INT8, NGT>(ng, act, k, w, gstride, y, ldy, n_valid, first, unpacked);
}

// M rows a tile: MT as words, MT_DIGITS as digits; int8 activations (one sum an output, as words) MT_INT8 past
// MAX_DIGIT_ROWS_INT8 rows (MT_INT8_FEW x 1 group up to MAX_FEW_ROWS_INT8), MT_DIGITS up to them.
template <bool WORDS, bool INT8 = false, int M = WORDS ? MT : MT_DIGITS, int NGT = NG>
inline void tile_format(int fmt, int rows, int ng, const Activations& act, int64_t k, const uint8_t* w, int64_t gstride,
                        float* y, int64_t ldy, int64_t n_valid, bool first, const uint8_t* unpacked = nullptr) {
  with_kquant_format(fmt, 0, [&](auto F) {
    tile_rows<decltype(F)::value, WORDS, INT8, M, NGT>(rows, ng, act, k, w, gstride, y, ldy, n_valid, first, unpacked);
    return 0;
  });
}

void gemm(const Segment* segs, int count, const float* x, int64_t m, int64_t k, int64_t n, float* y, int threads,
          bool int8) {
  int64_t rows[TM_KQUANT_MAX_SEGMENTS];
  bool half_sums = false;
  for (int s = 0; s < count; ++s) {
    rows[s] = segs[s].rows;
    half_sums |= half_scales(segs[s].fmt);
  }
  const bool words = !int8 && m > MAX_DIGIT_ROWS, wide = m > MAX_DIGIT_ROWS_INT8;
  const bool few = int8 && wide && MT_INT8_FEW > 0 && m <= MAX_FEW_ROWS_INT8;
  const int mt = few ? MT_INT8_FEW : int8 ? (wide ? wide_rows(MT_INT8) : MT_DIGITS) : words ? wide_rows(MT) : MT_DIGITS;
  // Many tiles of rows a group (int8 past MAX_DIGIT_ROWS_INT8, or words): the weights and scales of the formats that
  // take them unpacked once a pass into the thread's buffer, which the tiles of rows then read (UNPACK_TILES). Where
  // only the scales are (Q4_K), after the pass's first tile, which read them as it streamed the weights: unpacked
  // before it, each of their lines came from memory in turn (a 1B step at 16 streams no faster than without).
  const bool unpack = UNPACK_TILES > 0 && !few && ((int8 && wide) || words) && m >= UNPACK_TILES * mt;
  const auto ahead = [&](int fmt, bool as_words, int ng, bool first, const uint8_t* wg, int64_t gstride) -> const uint8_t* {
    if (!unpack || !(weights_ahead(fmt) || scales_ahead(fmt))) return nullptr;
    if (!weights_ahead(fmt) && first) return nullptr;  // the scales alone: unpacked after this tile (after_first)
    return unpacked_ahead(fmt, as_words, ng, k, first, wg, gstride);
  };
  const auto after_first = [&](int fmt, bool as_words, int ng, bool first, const uint8_t* wg, int64_t gstride) {
    if (unpack && first && !weights_ahead(fmt) && scales_ahead(fmt)) unpacked_ahead(fmt, as_words, ng, k, true, wg, gstride);
  };
  vnni::drive(x, m, k, y, n, rows, count, half_sums, mt, few ? 1 : NG, threads,
              [&](int s, int r, int ng, const Activations& act, int64_t g0, float* yt, int64_t ldy, int64_t n_valid, bool first) {
                const int fmt = segs[s].fmt;
                const int64_t gstride = (k / QK_K) * group_super_bytes(fmt);
                const uint8_t* wg = segs[s].w + g0 * gstride;
                if (few) {
                  if constexpr (MT_INT8_FEW > 0)
                    tile_format<false, true, MT_INT8_FEW, 1>(fmt, r, ng, act, k, wg, gstride, yt, ldy, n_valid, first);
                } else if (int8 && wide) {
                  tile_format<false, true, MT_INT8>(fmt, r, ng, act, k, wg, gstride, yt, ldy, n_valid, first,
                                                    ahead(fmt, false, ng, first, wg, gstride));
                  after_first(fmt, false, ng, first, wg, gstride);
                } else if (int8)
                  tile_format<false, true, MT_DIGITS>(fmt, r, ng, act, k, wg, gstride, yt, ldy, n_valid, first);
                // Only the forms this backend takes are built (the scalar build's compile 54 s -> 36 s).
                else if (words) {
                  if constexpr (MAX_DIGIT_ROWS < INT64_MAX) {
                    tile_format<true>(fmt, r, ng, act, k, wg, gstride, yt, ldy, n_valid, first,
                                      ahead(fmt, true, ng, first, wg, gstride));
                    after_first(fmt, true, ng, first, wg, gstride);
                  }
                } else if constexpr (MAX_DIGIT_ROWS > 0) {
                  tile_format<false>(fmt, r, ng, act, k, wg, gstride, yt, ldy, n_valid, first);
                }
              },
              words, int8);
}

// The segments of weights w for n rows of k in format fmt, or the entry points' error code (-1, -2, -3).
int checked_segments(int fmt, const uint8_t* w, int64_t n, int64_t k, Segment segs[TM_KQUANT_MAX_SEGMENTS]) {
  if (fmt != TM_KQUANT_MIXED && !source_block_bytes(fmt)) return -1;
  if (k % QK_K) return -2;
  const int count = segments_of(fmt, w, n, segs);
  return count ? count : -3;
}

int checked_gemm(int fmt, const float* x, int64_t m, int64_t k, const uint8_t* w, int64_t n, float* y, int threads,
                 bool int8) {
  Segment segs[TM_KQUANT_MAX_SEGMENTS];
  const int count = checked_segments(fmt, w, n, k, segs);
  if (count < 0) return count;
  gemm(segs, count, x, m, k, n, y, threads, int8);
  return 0;
}

}  // namespace

extern "C" {

// Bytes tm_kquant_pack writes for n rows of k weights in format fmt (0 for an unknown format).
int64_t tm_kquant_packed_bytes(int fmt, int64_t n, int64_t k) {
  if (!source_block_bytes(fmt)) return 0;
  return (n + G - 1) / G * (k / QK_K) * group_super_bytes(fmt);
}

// Returns 0, -1 for an unknown format, -2 for k not a multiple of 256.
int tm_kquant_pack(int fmt, const uint8_t* src, int64_t n, int64_t k, uint8_t* out) {
  if (!source_block_bytes(fmt)) return -1;
  if (k % QK_K) return -2;
  return pack(fmt, src, n, k, out);
}

// Returns 0, -1 for an unknown format, -2 for k not a multiple of 256, -3 for a mixed header that
// does not describe n rows.
int tm_kquant_gemm(int fmt, const float* x, int64_t m, int64_t k, const uint8_t* w, int64_t n, float* y, int threads) {
  return checked_gemm(fmt, x, m, k, w, n, y, threads, false);
}

// tm_kquant_gemm with the activations as 8-bit integers per block of 32 (vnni_gemm.cpp's tm_vnni_quantize_int8),
// the opt-in faster, less precise mode. The same return codes.
int tm_kquant_gemm_int8(int fmt, const float* x, int64_t m, int64_t k, const uint8_t* w, int64_t n, float* y,
                        int threads) {
  return checked_gemm(fmt, x, m, k, w, n, y, threads, true);
}

// The packed weights [n, k] as float32, exactly gguf's dequantized values.
int tm_kquant_dequantize(int fmt, const uint8_t* w, int64_t n, int64_t k, float* out) {
  Segment segs[TM_KQUANT_MAX_SEGMENTS];
  const int count = checked_segments(fmt, w, n, k, segs);
  if (count < 0) return count;
  for (int s = 0; s < count; ++s) {
    dequantize(segs[s].fmt, segs[s].w, segs[s].rows, k, out);
    out += segs[s].rows * k;
  }
  return 0;
}
}
