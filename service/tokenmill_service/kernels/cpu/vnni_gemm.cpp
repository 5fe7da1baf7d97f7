// y[M, N] = x[M, K] @ W[N, K]^T for W in GGUF's block formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, MXFP4), with integer
// products (AVX-512 VNNI: vpdpbusd multiplies 64 bytes by 64 bytes and adds them in fours into
// 16 int32 lanes). 2.1 to 2.7 times the float32 kernel's rate (block_gemm.cpp).
//
// Activations: each block of 32 becomes 16-bit fixed point, x ~ dq * (256 * hi + lo) with
// dq = max|x| / (127 * 256) and hi, lo int8 digits (lo is the rounded remainder, |lo| <= 128, 128
// kept as 127). llama.cpp keeps only hi (8 bits, its Q8_1); on SmolLM2 that alone moves prompt
// logprobs by 0.07 on average, over the default's bound of 0.03, while two digits stay within
// about 1e-3 of the float32 reference. Up to 4 rows (decoding, where the weights' bytes bound the time),
// each digit is one pass of vpdpbusd over the same unpacked weights, and the two integer sums meet exactly
// (hi * 256 + lo) before one conversion to float. More rows of Q5_0, Q5_1, IQ4_NL and MXFP4 (all k-quants in
// kquant_gemm.cpp; see gemm below) take hi * 256 + lo as one int16 (it fits: vnni_common.h) and the weights
// widened to int16, one pass of vpdpwssd (two int16 products a lane
// where vpdpbusd takes four int8 ones: as many instructions), whose exact sum is the same integer: the
// same bits, without the second sum per output and the shift and add per block, so 4 rows by 2 groups fit
// in the registers where digits took 3. On Zen 4 vpdpbusd, vpdpwssd and the float multiplies and FMAs of
// the per-block fold share two pipes, which bounds both ways alike for the 4-bit formats (measured the
// same speed); where unpacking takes more instructions (Q5_0, Q5_1, k-quants' higher bits) words measured
// 5-20 % faster.
//
// Batch-invariant: the integer sums are exact, every float32 step is done per output in one fixed
// order (block after block along K), and the activations are quantized row by row, so a row's
// result never depends on the other rows, the tiling or the thread count.
//
// Layout (tm_vnni_pack): the weight rows go in groups of 16, so that one 512-bit register holds 4
// consecutive weights of each of 16 rows and the 16 int32 lanes of vpdpbusd are 16 outputs; one
// activation dword is broadcast to all lanes. Per group and block of 32 weights:
//   4-bit formats: 4 x 64 bytes; byte i of part s holds, for row i / 4 and weight i % 4, step 2s's
//                  weight in its low nibble and step 2s+1's in its high nibble (step j: weights
//                  4j..4j+3 of the block);
//   Q5_0, Q5_1:    their low four bits as Q4_0's, then their fifth bits in one 64-byte plane laid out
//                  as the nibbles are (byte i: bit j for step j), unpacked by a shift and a ternary
//                  select, as kquant_gemm.cpp reads Q5_K's;
//   IQ4_NL, MXFP4: their 4-bit indices as Q4_0's nibbles, each turned into q = value + 128 by one byte
//                  shuffle over the 16 values in the loop (IQ4_NL's levels; MXFP4's e2m1 values doubled,
//                  its e8m0 scale 2^(E - 127) halved into d = 2^(E - 128), exact in float16 for E - 128
//                  in [-24, 15]: trained weights' scales lie far inside; a block beyond it is refused);
//   Q8_0:          8 x 64 bytes, step j's weights as unsigned bytes (q + 128);
//   then the 16 rows' scales d as float16, and for Q4_1 and Q5_1 their 16 minimums m.
// Every format becomes  w = d * q + m  with unsigned q: Q4_0's m is -8d, Q5_0's -16d, Q8_0's, IQ4_NL's
// and MXFP4's -128d (exact in float32, computed in the kernel), so  sum_k w x  =  d * dx * sum q a  +  m * dx * sum a  with
// dx the activation block's scale (dq above). Packed, each format takes as many bytes as it does in the file.

#include "tm_abi.h"  // the block formats and this file's prototypes (generated from abi.py)
#include "vnni_common.h"  // the activations' fixed point and the tiles' driver, shared with kquant_gemm.cpp

#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VNNI__) || !defined(__F16C__)
#error "vnni_gemm needs AVX-512F/BW, AVX-512 VNNI and F16C"
#endif

namespace {

using vnni::dword_at;
using vnni::G;
using vnni::half_bits;
using vnni::put_planes;
using vnni::QK;
using vnni::total;
using vnni::quantize_row;
#ifndef VNNI_MT  // (a dev script may try other tiles)
#define VNNI_MT 4
#define VNNI_NG 2
#endif
constexpr int MT = VNNI_MT;  // activation rows per register tile (as words)
constexpr int NG = VNNI_NG;  // groups per register tile
constexpr int MT_DIGITS = 4;   // activation rows per register tile as digits (a few rows: one group a tile)
constexpr int64_t MAX_DIGIT_ROWS = 4;  // products of at most this many rows take the digits (see kquant_gemm.cpp)

enum Format : int {
  Q4_0 = TM_FORMAT_Q4_0,
  Q4_1 = TM_FORMAT_Q4_1,
  Q5_0 = TM_FORMAT_Q5_0,
  Q5_1 = TM_FORMAT_Q5_1,
  Q8_0 = TM_FORMAT_Q8_0,
  IQ4_NL = TM_FORMAT_IQ4_NL,
  MXFP4 = TM_FORMAT_MXFP4
};

// IQ4_NL's 16 levels (ggml's kvalues_iq4nl) + 128: the unsigned q the product takes.
alignas(16) constexpr uint8_t IQ4_Q[16] = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};
// MXFP4's e2m1 values doubled (ggml's kvalues_mxfp4: 0, 1, 2, 3, 4, 6, 8, 12 and their negatives) + 128.
alignas(16) constexpr uint8_t MXFP4_Q[16] = {128, 129, 130, 131, 132, 134, 136, 140,
                                             128, 127, 126, 125, 124, 122, 120, 116};

int64_t source_block_bytes(int fmt) {
  switch (fmt) {
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

constexpr bool byte_weights(int fmt) { return fmt == Q8_0; }  // else nibbles
constexpr bool fifth_bit(int fmt) { return fmt == Q5_0 || fmt == Q5_1; }  // and a plane of fifth bits
constexpr bool level_indices(int fmt) { return fmt == IQ4_NL || fmt == MXFP4; }  // nibbles that index a table
constexpr const uint8_t* levels_of(int fmt) { return fmt == MXFP4 ? MXFP4_Q : IQ4_Q; }
constexpr bool stored_min(int fmt) { return fmt == Q4_1 || fmt == Q5_1; }
constexpr int64_t quant_bytes(int fmt) { return byte_weights(fmt) ? 512 : fifth_bit(fmt) ? 256 + 64 : 256; }
constexpr int64_t group_block_bytes(int fmt) { return quant_bytes(fmt) + (stored_min(fmt) ? 2 : 1) * G * 2; }
// What m is in units of d, for the formats whose m follows from d.
constexpr float implied_min(int fmt) {
  return fmt == Q8_0 || level_indices(fmt) ? -128.0f : fmt == Q5_0 ? -16.0f : -8.0f;
}

// One source block's 32 weights as unsigned q (IQ4_NL, MXFP4: the value's index), its d and (Q4_1, Q5_1) m,
// as float16 bits. False for an MXFP4 block whose scale float16 cannot hold.
bool unpack_source(int fmt, const uint8_t* b, uint8_t q[QK], uint16_t& d, uint16_t& m) {
  d = half_bits(b);
  m = stored_min(fmt) ? half_bits(b + 2) : 0;
  if (fmt == MXFP4) {  // E | qs[16] (weights j and j + 16)
    bool zero = true;
    for (int j = 0; j < 16; ++j) {
      q[j] = b[1 + j] & 0x0F;
      q[j + 16] = b[1 + j] >> 4;
      zero &= (q[j] & 7) == 0 && (q[j + 16] & 7) == 0;  // indices 0 and 8 are +-0
    }
    const int e = (int)b[0] - 128;  // d = 2^e
    if (zero) d = 0;
    else if (e >= -14 && e <= 15) d = (uint16_t)((e + 15) << 10);  // normal float16
    else if (e >= -24 && e < -14) d = (uint16_t)(1u << (e + 24));  // subnormal float16
    else return false;
  } else if (fifth_bit(fmt)) {  // d | (Q5_1: m) | qh u32 (bit j: weight j's fifth bit) | qs[16] (weights j and j + 16)
    const uint8_t* h = b + (fmt == Q5_1 ? 4 : 2);
    uint32_t qh;
    memcpy(&qh, h, 4);
    for (int j = 0; j < 16; ++j) {
      q[j] = (uint8_t)((h[4 + j] & 0x0F) | ((qh >> j) & 1) << 4);
      q[j + 16] = (uint8_t)((h[4 + j] >> 4) | ((qh >> (j + 16)) & 1) << 4);
    }
  } else if (fmt == Q8_0) {
    for (int j = 0; j < QK; ++j) q[j] = (uint8_t)((int)(int8_t)b[2 + j] + 128);
  } else {
    const uint8_t* qs = b + (fmt == Q4_1 ? 4 : 2);
    for (int j = 0; j < 16; ++j) {
      q[j] = qs[j] & 0x0F;
      q[j + 16] = qs[j] >> 4;
    }
  }
  return true;
}

// Packs rows [n] x [k / 32 blocks] of source blocks into groups of 16 (rows past n are zero). The format a
// template argument, each row's bytes of a plane written as one word.
template <int fmt>
int pack_format(const uint8_t* src, int64_t n, int64_t k, uint8_t* out) {
  const int64_t blocks = k / QK, sbytes = source_block_bytes(fmt), gbb = group_block_bytes(fmt);
  const int64_t groups = (n + G - 1) / G;
  int bad = 0;  // a source block the format cannot hold
  // Each group of G rows is its own stretch of the output: the groups are packed in parallel.
#pragma omp parallel for schedule(static) reduction(| : bad)
  for (int64_t g = 0; g < groups; ++g) {
  memset(out + g * blocks * gbb, 0, blocks * gbb);
  uint8_t q[QK];
  for (int64_t r = g * G; r < std::min(n, (g + 1) * G) && !bad; ++r) {
    const int64_t row = r % G;
    for (int64_t b = 0; b < blocks; ++b) {
      uint16_t d, m;
      if (!unpack_source(fmt, src + (r * blocks + b) * sbytes, q, d, m)) {
        bad = 1;
        break;
      }
      uint8_t* dst = out + (g * blocks + b) * gbb;
      if constexpr (byte_weights(fmt)) {
        for (int step = 0; step < QK / 4; ++step) memcpy(dst + step * 64 + row * 4, q + 4 * step, 4);
      } else {
        put_planes<4, 0>(q, dst + row * 4);
        if constexpr (fifth_bit(fmt)) put_planes<1, 4>(q, dst + 256 + row * 4);
      }
      memcpy(dst + quant_bytes(fmt) + row * 2, &d, 2);
      if (stored_min(fmt)) memcpy(dst + quant_bytes(fmt) + G * 2 + row * 2, &m, 2);
    }
  }
  }
  return bad ? -3 : 0;
}

int pack(int fmt, const uint8_t* src, int64_t n, int64_t k, uint8_t* out) {
  switch (fmt) {
    case Q4_0: return pack_format<Q4_0>(src, n, k, out);
    case Q4_1: return pack_format<Q4_1>(src, n, k, out);
    case Q5_0: return pack_format<Q5_0>(src, n, k, out);
    case Q5_1: return pack_format<Q5_1>(src, n, k, out);
    case Q8_0: return pack_format<Q8_0>(src, n, k, out);
    case IQ4_NL: return pack_format<IQ4_NL>(src, n, k, out);
    case MXFP4: return pack_format<MXFP4>(src, n, k, out);
    default: return -1;
  }
}

// Step t's nibbles w with their fifth bits (bit t of each byte of plane) set above them: a 16-bit shift
// brings bit t to bit 4 within every byte, and 0xF8 selects w | (shifted & 0x10).
inline __m512i with_fifth_bit(__m512i w, __m512i plane, int t) {
  const __m512i at4 = t < 4 ? _mm512_slli_epi16(plane, 4 - t) : t > 4 ? _mm512_srli_epi16(plane, t - 4) : plane;
  return _mm512_ternarylogic_epi32(w, at4, _mm512_set1_epi8(0x10), 0xF8);
}

// Step 2s's and step 2s + 1's weights q (4 each of 16 rows) as unsigned bytes, from block p's parts.
template <int F>
inline void step_bytes(const uint8_t* p, int s, __m512i& w0, __m512i& w1) {
  if constexpr (byte_weights(F)) {
    w0 = _mm512_loadu_si512(p + (2 * s) * 64);
    w1 = _mm512_loadu_si512(p + (2 * s + 1) * 64);
  } else {
    const __m512i v = _mm512_loadu_si512(p + s * 64), nibble = _mm512_set1_epi8(0x0F);
    w0 = _mm512_and_si512(v, nibble);
    w1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
    if constexpr (fifth_bit(F)) {
      const __m512i plane = _mm512_loadu_si512(p + 256);
      w0 = with_fifth_bit(w0, plane, 2 * s);
      w1 = with_fifth_bit(w1, plane, 2 * s + 1);
    }
    if constexpr (level_indices(F)) {
      const __m512i levels = _mm512_broadcast_i32x4(_mm_load_si128((const __m128i*)levels_of(F)));  // each 16-byte lane
      w0 = _mm512_shuffle_epi8(levels, w0);
      w1 = _mm512_shuffle_epi8(levels, w1);
    }
  }
}

// The same weights q0 .. q7 of each row as int16 pairs, vpdpwssd's operand (vnni_common.h's order).
template <int F>
inline void step_words(const uint8_t* p, int s, __m512i wq[4]) {
  if constexpr (!byte_weights(F) && !fifth_bit(F) && !level_indices(F)) {
    vnni::nibbles_as_words(_mm512_loadu_si512(p + s * 64), wq);  // Q4_0, Q4_1: straight from the nibbles
  } else {
    __m512i w0, w1;
    step_bytes<F>(p, s, w0, w1);
    vnni::bytes_as_words(w0, w1, wq);
  }
}

// y[i, 16g + l] for M activation rows (a: stride 2k bytes) and NGT groups starting at w. WORDS: the activations
// as one int16 each (quantize_row_words) and vpdpwssd; else as two int8 digits and vpdpbusd: the same integer
// sums (see kquant_gemm.cpp's tile).
// Not inlined: inlined into the driver's loop, the one-row tile ran 1.15 times as long (Q8_0, in cache).
template <int F, int M, int NGT, bool WORDS>
__attribute__((noinline)) void tile(const int8_t* a, const float* dx, const float* sx, int64_t k, const uint8_t* w, int64_t gstride,
                 float* y, int64_t ldy, int64_t n_valid) {
  constexpr int PARTS = !WORDS ? 2 : M * NGT >= 4 ? 1 : M * NGT >= 2 ? 2 : 4;
  const int64_t blocks = k / QK;
  __m512 acc[M][NGT];
  for (int i = 0; i < M; ++i)
    for (int g = 0; g < NGT; ++g) acc[i][g] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i qa[M][NGT][PARTS];
    for (int i = 0; i < M; ++i)
      for (int g = 0; g < NGT; ++g)
        for (int u = 0; u < PARTS; ++u) qa[i][g][u] = _mm512_setzero_si512();
    const uint8_t* wb = w + b * group_block_bytes(F);
    if constexpr (NGT == 1 && !WORDS && M >= 2)
      if (gstride >= vnni::PREFETCH_AHEAD) vnni::prefetch_l2(wb + vnni::PREFETCH_AHEAD, group_block_bytes(F));
#pragma GCC unroll 4
    for (int s = 0; s < 4; ++s) {  // two steps of 4 weights each
      if constexpr (WORDS) {
        __m512i wq[NGT][4];
        for (int g = 0; g < NGT; ++g) step_words<F>(wb + g * gstride, s, wq[g]);
        for (int i = 0; i < M; ++i) {
          const int8_t* ai = a + i * 2 * k + b * 2 * QK + 16 * s;  // the 8 activations' words
          for (int u = 0; u < 4; ++u) {
            const __m512i au = _mm512_set1_epi32(dword_at(ai + 4 * u));
            for (int g = 0; g < NGT; ++g) qa[i][g][u % PARTS] = _mm512_dpwssd_epi32(qa[i][g][u % PARTS], wq[g][u], au);
          }
        }
      } else {
        __m512i w0[NGT], w1[NGT];
        for (int g = 0; g < NGT; ++g) step_bytes<F>(wb + g * gstride, s, w0[g], w1[g]);
        for (int i = 0; i < M; ++i) {
          const int8_t* ai = a + i * 2 * k + b * 2 * QK + 8 * s;
          const __m512i h0 = _mm512_set1_epi32(dword_at(ai)), h1 = _mm512_set1_epi32(dword_at(ai + 4));
          const __m512i l0 = _mm512_set1_epi32(dword_at(ai + QK)), l1 = _mm512_set1_epi32(dword_at(ai + QK + 4));
          for (int g = 0; g < NGT; ++g) {
            qa[i][g][0] = _mm512_dpbusd_epi32(qa[i][g][0], w0[g], h0);
            qa[i][g][0] = _mm512_dpbusd_epi32(qa[i][g][0], w1[g], h1);
            qa[i][g][1] = _mm512_dpbusd_epi32(qa[i][g][1], w0[g], l0);
            qa[i][g][1] = _mm512_dpbusd_epi32(qa[i][g][1], w1[g], l1);
          }
        }
      }
    }
    for (int g = 0; g < NGT; ++g) {
      const uint8_t* sc = wb + g * gstride + quant_bytes(F);
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)sc));
      const __m512 m = stored_min(F) ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(sc + 2 * G)))
                                     : _mm512_mul_ps(d, _mm512_set1_ps(implied_min(F)));
      for (int i = 0; i < M; ++i) {
        const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(dx[i * blocks + b]));
        const __m512i isum = total<WORDS>(qa[i][g]);  // exact
        acc[i][g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), scale, acc[i][g]);
        acc[i][g] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[i * blocks + b]), acc[i][g]);
      }
    }
  }
  for (int g = 0; g < NGT; ++g) {
    const int64_t left = n_valid - g * G;
    if (left <= 0) break;
    const __mmask16 mask = left >= G ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
    for (int i = 0; i < M; ++i) _mm512_mask_storeu_ps(y + i * ldy + g * G, mask, acc[i][g]);
  }
}

// tile<F, M, ng, WORDS> for ng = NGT, NGT - 1, ..., 1.
template <int F, int M, bool WORDS, int NGT = NG>
inline void tile_groups(int ng, const int8_t* a, const float* dx, const float* sx, int64_t k, const uint8_t* w,
                        int64_t gstride, float* y, int64_t ldy, int64_t n_valid) {
  if constexpr (NGT > 1)
    if (ng < NGT) return tile_groups<F, M, WORDS, NGT - 1>(ng, a, dx, sx, k, w, gstride, y, ldy, n_valid);
  tile<F, M, NGT, WORDS>(a, dx, sx, k, w, gstride, y, ldy, n_valid);
}

// tile_groups<F, rows, WORDS> for rows = M, M - 1, ..., 1.
template <int F, bool WORDS, int M = WORDS ? MT : MT_DIGITS>
inline void tile_rows(int rows, int ng, const int8_t* a, const float* dx, const float* sx, int64_t k, const uint8_t* w,
                      int64_t gstride, float* y, int64_t ldy, int64_t n_valid) {
  if constexpr (M > 1)
    if (rows < M) return tile_rows<F, WORDS, M - 1>(rows, ng, a, dx, sx, k, w, gstride, y, ldy, n_valid);
  tile_groups<F, M, WORDS>(ng, a, dx, sx, k, w, gstride, y, ldy, n_valid);
}

template <int F>
void gemm(const float* x, int64_t m, int64_t k, const uint8_t* w, int64_t n, float* y, int threads) {
  const int64_t gstride = (k / QK) * group_block_bytes(F);
  // Words pay where unpacking takes more than a mask and a shift (Q5_0, Q5_1's fifth bits, IQ4_NL's and MXFP4's
  // lookups: 3-11 % faster from 16 rows up). Q8_0's bytes take no unpacking as digits and two instructions a
  // vector as words, Q4_0's and Q4_1's nibbles two and four: words measured the same to 1-2 % slower there, so
  // they keep the digits at every M, past 4 rows in the 3-row tiles that leave the second sums room.
  const bool words = m > MAX_DIGIT_ROWS && (fifth_bit(F) || level_indices(F));
  const int mt = words ? MT : m > MAX_DIGIT_ROWS ? 3 : MT_DIGITS;
  vnni::drive(x, m, k, y, n, &n, 1, false, mt, NG, threads,
              [&](int, int rows, int ng, const vnni::Activations& r, int64_t g0, float* yt, int64_t ldy,
                  int64_t n_valid) {
                if (words)
                  tile_rows<F, true>(rows, ng, r.a, r.dx, r.sx, k, w + g0 * gstride, gstride, yt, ldy, n_valid);
                else
                  tile_rows<F, false>(rows, ng, r.a, r.dx, r.sx, k, w + g0 * gstride, gstride, yt, ldy, n_valid);
              },
              words);
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
  switch (fmt) {
    case Q4_0: gemm<Q4_0>(x, m, k, w, n, y, threads); break;
    case Q4_1: gemm<Q4_1>(x, m, k, w, n, y, threads); break;
    case Q5_0: gemm<Q5_0>(x, m, k, w, n, y, threads); break;
    case Q5_1: gemm<Q5_1>(x, m, k, w, n, y, threads); break;
    case IQ4_NL: gemm<IQ4_NL>(x, m, k, w, n, y, threads); break;
    case MXFP4: gemm<MXFP4>(x, m, k, w, n, y, threads); break;
    default: gemm<Q8_0>(x, m, k, w, n, y, threads); break;
  }
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
      const float d = _cvtsh_ss(half_bits(src + quant_bytes(fmt) + row * 2));
      const float m =
          stored_min(fmt) ? _cvtsh_ss(half_bits(src + quant_bytes(fmt) + G * 2 + row * 2)) : implied_min(fmt) * d;
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
}
