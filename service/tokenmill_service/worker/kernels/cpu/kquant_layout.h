// The k-quants as kquant_gemm.cpp's tiles read them: the formats' facts, a source block unpacked, a group's
// packed super-blocks (Packed), the packing from the file's blocks and back to float32 (the layout:
// kquant_gemm.cpp's head), a tile's step of packed weights unpacked (step_bytes, step_words), a group's weights
// and scales unpacked ahead for many tiles of rows (unpacked_ahead), and a mixed layer's segments.
// Included by kquant_gemm.cpp alone; kept apart so that the products' file holds the products.
#pragma once

#include "tm_abi.h"       // the block formats (generated from abi.py)
#include "vnni_common.h"  // the groups, the planes' layout

namespace {

using namespace simd;
using vnni::Activations;
using vnni::dword_at;
using vnni::G;
using vnni::half_bits;
using vnni::put_planes;
using vnni::QK;
using vnni::total;

constexpr int64_t QK_K = TM_BLOCK_WEIGHTS_Q4_K;  // weights per super-block
constexpr int64_t SUBS = QK_K / QK;               // blocks of 32 per super-block
static_assert(TM_BLOCK_WEIGHTS_Q5_K == QK_K && TM_BLOCK_WEIGHTS_Q6_K == QK_K && TM_BLOCK_WEIGHTS_IQ4_XS == QK_K &&
                  TM_BLOCK_WEIGHTS_Q2_K == QK_K && TM_BLOCK_WEIGHTS_Q3_K == QK_K,
              "k-quants: one super-block size");

// IQ4_NL's (and IQ4_XS's) 16 levels, ggml's kvalues_iq4nl.
constexpr int8_t IQ4_LEVELS[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
// The same as the unsigned q the product takes (level + 128).
alignas(16) constexpr uint8_t IQ4_Q[16] = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};
constexpr bool iq4_q_matches_levels() {
  for (int i = 0; i < 16; ++i)
    if (IQ4_Q[i] != IQ4_LEVELS[i] + 128) return false;
  return true;
}
static_assert(iq4_q_matches_levels(), "IQ4_Q: IQ4_NL's levels + 128");

// Formats with an int8 scale per 16 and no minimum (Q6_K's way), and the offset of their q.
constexpr bool signed_scales(int fmt) { return fmt == Q6_K || fmt == IQ4_XS || fmt == Q3_K; }
constexpr int q_offset(int fmt) { return fmt == IQ4_XS ? 128 : fmt == Q3_K ? 4 : 32; }
// Formats whose nibble is an index into IQ4_NL's levels (q = level + 128) rather than q's low bits.
constexpr bool level_indices(int fmt) { return fmt == IQ4_XS; }
// Formats with a scale per 16 weights (folded at each half block of 32) rather than per 32.
constexpr bool half_scales(int fmt) { return signed_scales(fmt) || fmt == Q2_K; }

int64_t source_block_bytes(int fmt) { return tm_kquant_block_bytes(fmt); }

// A weight's low bits (4: a nibble; Q3_K's 2), and the bits above them.
constexpr int low_bits(int fmt) { return fmt == Q3_K || fmt == Q2_K ? 2 : 4; }
constexpr int64_t high_bits(int fmt) { return fmt == Q6_K ? 2 : fmt == Q5_K || fmt == Q3_K ? 1 : 0; }
// A block's bytes: the planes of its weights' low bits, then those of their higher bits (read in one stream).
constexpr int64_t block_quant_bytes(int fmt) { return 64 * (low_bits(fmt) + high_bits(fmt)); }
constexpr int64_t quant_bytes(int fmt) { return SUBS * block_quant_bytes(fmt); }  // a group's super-block
constexpr int64_t mask_bytes(int) { return 0; }  // the planes sit with their block's nibbles
// Where step t's low or higher bits sit among their planes: plane t / (8 / bits), bits from (t % (8 / bits)) * bits
// (for the 4 low bits: plane t / 2, the low nibble for an even step).
constexpr int plane_of(int bits, int t) { return t / (8 / bits); }
constexpr int shift_of(int bits, int t) { return (t % (8 / bits)) * bits; }
// Q4_K's and Q5_K's 6-bit scales and minimums in the file's 12 bytes a row: a byte a block of sc << 2 | (m & 3),
// then a byte a pair of blocks of the minimums' high four bits (block 2r's in the low nibble). As bytes each, the
// packed Q4_K was 2.8 % larger than the file, and decoding reads every byte (a 1B's step 13 MB more than llama.cpp).
constexpr bool six_bit_scales(int fmt) { return fmt == Q4_K || fmt == Q5_K; }
// The signed scales' count a super-block: 16 (a half block's each), IQ4_XS 8 (a block's, its halves sharing it:
// as 16 the packed file was 7 % larger than the file), and where half block h's sits.
constexpr int signed_scale_count(int fmt) { return fmt == IQ4_XS ? 8 : 16; }
constexpr int64_t signed_scale_at(int fmt, int64_t h) { return G * 2 + (fmt == IQ4_XS ? h / 2 : h) * G; }
constexpr int64_t scale_bytes(int fmt) {
  return signed_scales(fmt)    ? G * 2 + signed_scale_count(fmt) * G
         : six_bit_scales(fmt) ? 2 * G * 2 + (SUBS + SUBS / 2) * G
                               : 2 * G * 2 + 16 * G;
}
// Where a six-bit-scales block j's byte of sc and low minimum bits sits, and its byte of high minimum bits.
constexpr int64_t six_bit_low(int64_t j) { return 4 * G + j * G; }
constexpr int64_t six_bit_high(int64_t j) { return 4 * G + SUBS * G + (j / 2) * G; }
// Where Q2_K's half block h's 4-bit scale and minimum sit, a byte a row as the file has them: sc | m << 4. As a byte
// each, the packed Q2_K was 1.19 times the file's size, and decoding reads every byte.
constexpr int64_t q2_scale_at(int64_t h) { return 4 * G + h * G; }
constexpr int64_t group_super_bytes(int fmt) { return quant_bytes(fmt) + mask_bytes(fmt) + scale_bytes(fmt); }

// How many steps (two byte products each) of format F's pair sums fit in int16: a product adds at most
// 2 * qmax * 128 to a pair (|a| <= 128), so Q4_K's 8 products of a block (30720), Q5_K's 4, Q6_K's 2; and a
// divisor of the steps to the next fold (a half block's 2 for the formats with a scale per 16, else 4).
constexpr int pair_steps(int fmt) {
  const int products = 32767 / (2 * ((1 << (low_bits(fmt) + high_bits(fmt))) - 1) * 128);
  const int steps = products / 2, fold = half_scales(fmt) ? 2 : 4;
  return steps >= fold ? fold : steps >= 2 ? 2 : 1;
}
static_assert(pair_steps(Q4_K) == 4 && pair_steps(Q5_K) == 2 && pair_steps(Q6_K) == 1 && pair_steps(Q2_K) == 2);

// One source super-block: its 256 weights as unsigned q (IQ4_XS: the level's 4-bit index), d, dmin (Q6_K, IQ4_XS,
// Q3_K: 0) as float16 bits, and the sub-block scales and minimums (Q6_K, IQ4_XS, Q3_K: 16 int8 scales, no
// minimums; Q2_K: 16 of each).
void unpack_source(int fmt, const uint8_t* b, uint8_t q[QK_K], uint16_t& d, uint16_t& dmin, int sc[16], int m[16]) {
  if (fmt == Q2_K) {  // scales[16] (low nibble sc, high m) | qs[64] | d | dmin
    for (int j = 0; j < 16; ++j) {
      sc[j] = b[j] & 0x0F;
      m[j] = b[j] >> 4;
    }
    // Byte l of each 32-byte half holds weights l, l + 32, l + 64, l + 96 of that half's 128.
    for (int h = 0; h < 2; ++h)
      for (int f = 0; f < 4; ++f)
        for (int l = 0; l < 32; ++l) q[128 * h + 32 * f + l] = (b[16 + 32 * h + l] >> (2 * f)) & 3;
    d = half_bits(b + 80);
    dmin = half_bits(b + 82);
    return;
  }
  if (fmt == Q3_K) {  // hmask[32] | qs[64] | scales[12] | d
    // The low bits as Q2_K's; weight i's high bit is bit i / 32 of hmask byte i % 32.
    for (int h = 0; h < 2; ++h)
      for (int f = 0; f < 4; ++f)
        for (int l = 0; l < 32; ++l) q[128 * h + 32 * f + l] = (b[32 + 32 * h + l] >> (2 * f)) & 3;
    for (int bit = 0; bit < 8; ++bit)
      for (int l = 0; l < 32; ++l) q[32 * bit + l] |= ((b[l] >> bit) & 1) << 2;
    // Scale s: its low 4 bits nibble s / 8 of byte s % 8, its high 2 bits field s / 4 of byte 8 + s % 4.
    const uint8_t* s = b + 96;
    for (int j = 0; j < 16; ++j)
      sc[j] = (((s[j % 8] >> (4 * (j / 8))) & 0x0F) | (((s[8 + j % 4] >> (2 * (j / 4))) & 3) << 4)) - 32;
    d = half_bits(b + 108);
    dmin = 0;
    return;
  }
  if (fmt == IQ4_XS) {  // d | scales_h u16 | scales_l[4] | qs[128]: sub-block s's byte j holds weights j, j + 16
    const int scales_h = b[2] | b[3] << 8;
    for (int s = 0; s < 8; ++s) {
      const int ls = ((b[4 + s / 2] >> (4 * (s % 2))) & 0x0F) | (((scales_h >> (2 * s)) & 3) << 4);
      sc[2 * s] = sc[2 * s + 1] = ls - 32;
      for (int j = 0; j < 16; ++j) {
        const uint8_t byte = b[8 + 16 * s + j];
        q[32 * s + j] = byte & 0x0F;
        q[32 * s + 16 + j] = byte >> 4;
      }
    }
    d = half_bits(b);
    dmin = 0;
    return;
  }
  if (fmt == Q6_K) {  // ql[128] qh[64] scales[16] d
    const uint8_t *ql = b, *qh = b + 128;
    for (int h = 0; h < 2; ++h)
      for (int l = 0; l < 64; ++l) {
        q[h * 128 + l] = ql[h * 64 + l] & 0x0F;
        q[h * 128 + 64 + l] = ql[h * 64 + l] >> 4;
      }
    for (int h = 0; h < 2; ++h)
      for (int s = 0; s < 4; ++s)
        for (int l = 0; l < 32; ++l) q[h * 128 + s * 32 + l] |= ((qh[h * 32 + l] >> (2 * s)) & 3) << 4;
    for (int j = 0; j < 16; ++j) sc[j] = (int8_t)b[192 + j];
    d = half_bits(b + 208);
    dmin = 0;
    return;
  }
  // Q4_K: d dmin scales[12] qs[128];  Q5_K: d dmin scales[12] qh[32] qs[128]
  d = half_bits(b);
  dmin = half_bits(b + 2);
  const uint8_t* s = b + 4;
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 63;
    m[j] = s[j + 4] & 63;
    sc[j + 4] = (s[j + 8] & 0x0F) | ((s[j] >> 6) << 4);
    m[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
  }
  const uint8_t* qs = b + (fmt == Q5_K ? 48 : 16);
  for (int c = 0; c < 4; ++c)
    for (int l = 0; l < 32; ++l) {
      q[64 * c + l] = qs[32 * c + l] & 0x0F;
      q[64 * c + 32 + l] = qs[32 * c + l] >> 4;
    }
  if (fmt == Q5_K)
    for (int j = 0; j < 8; ++j)
      for (int l = 0; l < 32; ++l) q[32 * j + l] |= ((b[16 + l] >> j) & 1) << 4;
}

// Where the parts of group g's super-block sb start.
struct Packed {
  const uint8_t* quants;  // [8 blocks]: [4 parts][64] nibbles, then [bits][64] planes
  const uint8_t* masks;   // [8 blocks][bits][64] planes of the bits above the nibbles (Q5_K: 1, Q6_K: 2)
  const uint8_t* scales;
  Packed(int fmt, const uint8_t* w, int64_t gstride, int64_t g, int64_t sb) {
    quants = w + g * gstride + sb * group_super_bytes(fmt);
    masks = quants + quant_bytes(fmt);
    scales = masks + mask_bytes(fmt);
  }
};

// The format a template argument and each row's bytes of a plane written as one word (put_planes): weight by
// weight, with the format a variable (a few integer divisions a weight), an 8B file's layers took 33 s to pack,
// most of its load time; now about 4.
template <int fmt>
int pack_format(const uint8_t* src, int64_t n, int64_t k, uint8_t* out) {
  const int64_t supers = k / QK_K, sbytes = source_block_bytes(fmt), gstride = supers * group_super_bytes(fmt);
  constexpr int low = low_bits(fmt), bits = (int)high_bits(fmt);
  // Each group of G rows is its own stretch of the output: the groups are packed in parallel; one group (a decoding
  // step's embedding row, dequantized through here) on the calling thread alone, with no region to wait on: its
  // other thread may be off its core then (the server process takes one for each streamed token), and the lookup
  // took 1.7 % of a 1B decoding step's samples (py-spy), 0.4 % so.
#pragma omp parallel for schedule(static) if (n > G)
  for (int64_t g = 0; g < (n + G - 1) / G; ++g) {
  memset(out + g * gstride, 0, gstride);
  uint8_t q[QK_K];
  int sc[16], m[16];
  for (int64_t r = g * G; r < std::min(n, (g + 1) * G); ++r) {
    const int64_t row = r % G;
    for (int64_t sb = 0; sb < supers; ++sb) {
      uint16_t d, dmin;
      unpack_source(fmt, src + (r * supers + sb) * sbytes, q, d, dmin, sc, m);
      const Packed p(fmt, out, gstride, g, sb);
      uint8_t* quants = const_cast<uint8_t*>(p.quants);
      uint8_t* scales = const_cast<uint8_t*>(p.scales);
      for (int blk = 0; blk < SUBS; ++blk) {
        uint8_t* bq = quants + blk * block_quant_bytes(fmt) + row * 4;
        put_planes<low, 0>(q + 32 * blk, bq);
        if constexpr (bits > 0) put_planes<bits, low>(q + 32 * blk, bq + 64 * low);
      }
      memcpy(scales + row * 2, &d, 2);
      if (signed_scales(fmt)) {
        for (int h = 0; h < 16; h += 16 / signed_scale_count(fmt))
          scales[signed_scale_at(fmt, h) + row] = (uint8_t)(int8_t)sc[h];
      } else {
        memcpy(scales + G * 2 + row * 2, &dmin, 2);
        if constexpr (six_bit_scales(fmt)) {
          for (int j = 0; j < SUBS; ++j) {  // 6-bit fields (unpack_source): the group's stretch was zeroed
            scales[six_bit_low(j) + row] = (uint8_t)(sc[j] << 2 | (m[j] & 3));
            scales[six_bit_high(j) + row] |= (uint8_t)((m[j] >> 2) << (4 * (j % 2)));
          }
        } else {
          for (int j = 0; j < 16; ++j) scales[q2_scale_at(j) + row] = (uint8_t)(sc[j] | m[j] << 4);
        }
      }
    }
  }
  }
  return 0;
}

// One segment's packed weights [rows, k] as float32, exactly gguf's dequantized values (row stride k).
void dequantize(int fmt, const uint8_t* w, int64_t n, int64_t k, float* out) {
  const int64_t supers = k / QK_K, gstride = supers * group_super_bytes(fmt);
  const int low = low_bits(fmt), bits = (int)high_bits(fmt);
  for (int64_t r = 0; r < n; ++r) {
    const int64_t g = r / G, row = r % G;
    for (int64_t sb = 0; sb < supers; ++sb) {
      const Packed p(fmt, w, gstride, g, sb);
      const float d = half_to_float(half_bits(p.scales + row * 2));
      for (int j = 0; j < QK_K; ++j) {
        const int blk = j / 32, step = (j % 32) / 4, i = (int)row * 4 + j % 4;
        const uint8_t* bq = p.quants + blk * block_quant_bytes(fmt);
        int q = (bq[plane_of(low, step) * 64 + i] >> shift_of(low, step)) & ((1 << low) - 1);
        if (level_indices(fmt)) q = IQ4_LEVELS[q] + 128;
        if (bits)
          q |= ((bq[64 * low + plane_of(bits, step) * 64 + i] >> shift_of(bits, step)) & ((1 << bits) - 1)) << low;
        float value;
        if (signed_scales(fmt)) {
          const float de = d * (float)(int8_t)p.scales[signed_scale_at(fmt, j / 16) + row];
          value = de * (float)(q - q_offset(fmt));
        } else {
          const float dmin = half_to_float(half_bits(p.scales + G * 2 + row * 2));
          int sc, m;
          if (six_bit_scales(fmt)) {
            const int low = p.scales[six_bit_low(blk) + row], high = p.scales[six_bit_high(blk) + row];
            sc = low >> 2;
            m = (low & 3) | ((high >> (4 * (blk % 2))) & 15) << 2;
          } else {
            const int both = p.scales[q2_scale_at(j / 16) + row];
            sc = both & 15;
            m = both >> 4;
          }
          const float de = d * (float)sc, dm = dmin * (float)m;
          value = de * (float)q - dm;
        }
        out[r * k + sb * QK_K + j] = value;
      }
    }
  }
}

// -- unpacking in the tiles: a step's weights as bytes or as int16 words, a block's scales as floats

inline f32x16 bytes_as_floats(const uint8_t* p, bool is_signed) {
  return to_float(is_signed ? load_s8_i((const int8_t*)p) : load_u8_i(p));
}

// A six-bit-scales block j's scales and minimums of the group's 16 rows, as floats (exact: integers below 64), from
// its pair's high bits (`pair`: the bytes at six_bit_high(j), loaded at the pair's first block). These ops come once
// a block a group, beside 16 products at one row: on an AMD EPYC, one row in the cache took 1.04-1.06 times as long
// as with the scales and minimums a byte each, and a 1B step's Q4_K products from memory 0.92-0.98 times as long.
inline void six_bit_scales_of(const uint8_t* scales, int64_t j, i32x16 pair, f32x16& sc, f32x16& m) {
  const i32x16 low = load_u8_i(scales + six_bit_low(j));
  const i32x16 high = j % 2 ? shr_i(pair, 4) : and_i(pair, set1_i(15));
  sc = to_float(shr_i(low, 2));
  m = to_float(or_i(and_i(low, set1_i(3)), shl_i(high, 2)));
}

// Each byte's field starting at bit `from` moved to start at bit `to`, the byte's other bits left for the
// caller to mask (16-bit shifts: the bits a byte takes from its neighbour land outside the field).
inline u8x64 shifted(u8x64 plane, int from, int to) {
  const int shift = to - from;
  return shift > 0 ? shl16(plane, shift) : shift < 0 ? shr16(plane, -shift) : plane;
}

// Step t's low bits (LOW of them, from the block's first planes) as bytes.
template <int LOW>
inline u8x64 low_bits_of(const uint8_t* bq, int t) {
  const u8x64 plane = load_b(bq + plane_of(LOW, t) * 64);
  return and_b(shifted(plane, shift_of(LOW, t), 0), set1_b((uint8_t)((1 << LOW) - 1)));
}

// Step t's low bits w with their higher bits (the planes after the low ones) set above them.
template <int LOW, int BITS>
inline u8x64 with_high_bits(u8x64 w, const u8x64 planes[2], int t) {
  const u8x64 high = shifted(planes[plane_of(BITS, t)], shift_of(BITS, t), LOW);
  // w | (high & bits LOW .. LOW + BITS - 1): one instruction on AVX-512 (vpternlogd).
  return or_and(w, high, set1_b((uint8_t)(((1 << BITS) - 1) << LOW)));
}

// Step 2s's and step 2s + 1's weights q (4 each of 16 rows) as unsigned bytes, from block bq's planes.
template <int F>
inline void step_bytes(const uint8_t* bq, int s, u8x64& w0, u8x64& w1) {
  constexpr int LOW = low_bits(F), BITS = (int)high_bits(F);
  if constexpr (LOW == 4) {
    const u8x64 v = load_b(bq + s * 64), nibble = set1_b(0x0F);
    w0 = and_b(v, nibble);
    w1 = and_b(shr16(v, 4), nibble);
  } else {
    w0 = low_bits_of<LOW>(bq, 2 * s);
    w1 = low_bits_of<LOW>(bq, 2 * s + 1);
  }
  if constexpr (BITS > 0) {
    u8x64 planes[2];
    for (int pl = 0; pl < BITS; ++pl) planes[pl] = load_b(bq + 64 * LOW + pl * 64);
    w0 = with_high_bits<LOW, BITS>(w0, planes, 2 * s);
    w1 = with_high_bits<LOW, BITS>(w1, planes, 2 * s + 1);
  }
  if constexpr (level_indices(F)) {
    // The indices looked up in IQ4_NL's levels + 128.
    w0 = lookup16(IQ4_Q, w0);
    w1 = lookup16(IQ4_Q, w1);
  }
}

// The same weights q0 .. q7 of each row as int16 pairs, dot_s16's operand (vnni_common.h's order).
template <int F>
inline void step_words(const uint8_t* bq, int s, u8x64 wq[4]) {
  if constexpr (low_bits(F) == 4 && high_bits(F) == 0 && !level_indices(F)) {
    vnni::nibbles_as_words(load_b(bq + s * 64), wq);  // Q4_K: straight from the nibbles
  } else {
    u8x64 w0, w1;
    step_bytes<F>(bq, s, w0, w1);
    vnni::bytes_as_words(w0, w1, wq);
  }
}

// A group's weights unpacked ahead, once for the many row tiles of a product of many rows (unpack_groups): step
// s of block j of super-block sb of group g as step_bytes gives it, w0 then w1 (k * 16 bytes a group), or as
// step_words does (WORDS: its four vectors, k * 32 bytes a group).
template <bool WORDS>
constexpr int64_t unpacked_step(int64_t k, int g, int64_t sb, int64_t j, int s) {
  return (g * k * G + ((sb * SUBS + j) * 4 + s) * 128) * (WORDS ? 2 : 1);
}
template <int F, bool WORDS>
void unpack_groups(const uint8_t* w, int64_t gstride, int ng, int64_t k, uint8_t* out) {
  for (int g = 0; g < ng; ++g)
    for (int64_t sb = 0; sb < k / QK_K; ++sb) {
      const uint8_t* quants = w + g * gstride + sb * group_super_bytes(F);
      for (int64_t j = 0; j < SUBS; ++j)
        for (int s = 0; s < 4; ++s) {
          vnni::prefetch_share<group_super_bytes(F), 4 * SUBS>(quants, 4 * j + s);
          uint8_t* o = out + unpacked_step<WORDS>(k, g, sb, j, s);
          u8x64 v[4];
          if constexpr (WORDS) step_words<F>(quants + j * block_quant_bytes(F), s, v);
          else step_bytes<F>(quants + j * block_quant_bytes(F), s, v[0], v[1]);
          for (int u = 0; u < (WORDS ? 4 : 2); ++u) store_b(o + 64 * u, v[u]);
        }
    }
}

// A group's scales ahead, for the same many row tiles, the tile's own exact products: block b of group g's d sc and
// dmin m (Q4_K, Q5_K: 16 floats each, at scales_ahead_at), its two halves' d sc (Q6_K, Q3_K), or each half's d sc
// and dmin m (Q2_K: four vectors a block), after the unpacked weights if the format has them (weights_ahead).
// Decoded in every tile of rows, the 6-bit fields took 10-15 % of AVX2's 8-bit Q4_K tile: read from here, 8-bit
// products of 16-512 rows took 0.88-0.94 of the time (Q4_K), 0.90-0.97 (Q6_K), 0.88-0.97 (Q2_K), words 0.96-0.98
// (Q4_K), 0.84-1.0 (Q6_K) and 0.96-1.0 (Q2_K). Not IQ4_XS (one scale a block: its 8-bit tile 1.02-1.04 times as slow).
constexpr bool weights_ahead(int fmt) { return high_bits(fmt) > 0; }
constexpr bool scales_ahead(int fmt) {
  return six_bit_scales(fmt) || fmt == Q2_K || (signed_scales(fmt) && fmt != IQ4_XS);
}
constexpr int64_t scales_ahead_at(int fmt, int64_t k, int g, int64_t b) {
  return (g * (k / QK) + b) * (fmt == Q2_K ? 4 : 2) * G;
}
// Block b of group g's scales in the buffer of a tile of NGT groups (ng = NGT where a tile reads it).
template <int F, int NGT, bool WORDS>
inline const float* ahead_scales(const uint8_t* unpacked, int64_t k, int g, int64_t b) {
  return (const float*)(unpacked + (weights_ahead(F) ? NGT * k * G * (WORDS ? 2 : 1) : 0)) + scales_ahead_at(F, k, g, b);
}
template <int F>
void unpack_scales(const uint8_t* w, int64_t gstride, int ng, int64_t k, float* out) {
  for (int g = 0; g < ng; ++g)
    for (int64_t sb = 0; sb < k / QK_K; ++sb) {
      const uint8_t* scales = Packed(F, w, gstride, g, sb).scales;
      const f32x16 d = load_half((const uint16_t*)scales);
      for (int64_t j = 0; j < SUBS; ++j) {
        float* o = out + scales_ahead_at(F, k, g, sb * SUBS + j);
        if constexpr (F == Q2_K) {  // each half's d sc, then its dmin m
          const f32x16 dmin = load_half((const uint16_t*)(scales + 2 * G));
          for (int h = 0; h < 2; ++h) {
            const i32x16 both = load_u8_i(scales + q2_scale_at(2 * j + h));  // sc | m << 4
            store(o + 2 * h * G, mul(d, to_float(and_i(both, set1_i(15)))));
            store(o + (2 * h + 1) * G, mul(dmin, to_float(shr_i(both, 4))));
          }
        } else if constexpr (six_bit_scales(F)) {
          f32x16 sc, m;
          six_bit_scales_of(scales, j, load_u8_i(scales + six_bit_high(j & ~1)), sc, m);
          store(o, mul(d, sc));
          store(o + G, mul(load_half((const uint16_t*)(scales + 2 * G)), m));
        } else {  // a scale each half block: its two halves' d sc
          for (int h = 0; h < 2; ++h) store(o + h * G, mul(d, bytes_as_floats(scales + signed_scale_at(F, 2 * j + h), true)));
        }
      }
    }
}

// The formats this file packs, and one call of f(std::integral_constant<int, F>{}) for fmt's F.
template <class Fn>
int with_kquant_format(int fmt, int otherwise, Fn&& f) {
  return vnni::with_format<Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS>(fmt, otherwise, f);
}

// The thread's buffer of ng groups at w unpacked ahead (their weights as bytes or as words where weights_ahead,
// then their scales where scales_ahead), unpacked first where `fresh` (a pass's first tile of rows; the later tiles
// of the pass find them there).
const uint8_t* unpacked_ahead(int fmt, bool words, int ng, int64_t k, bool fresh, const uint8_t* w, int64_t gstride) {
  static thread_local std::vector<float> buffer;  // floats, so that the scales are aligned as floats
  if (fresh) {
    const int64_t weight_bytes = weights_ahead(fmt) ? ng * k * G * (words ? 2 : 1) : 0;
    buffer.resize((size_t)(weight_bytes / 4 + (scales_ahead(fmt) ? scales_ahead_at(fmt, k, ng, 0) : 0)));
    uint8_t* out = (uint8_t*)buffer.data();
    with_kquant_format(fmt, 0, [&](auto F) {
      constexpr int f = decltype(F)::value;
      if constexpr (weights_ahead(f)) {
        if (words) unpack_groups<f, true>(w, gstride, ng, k, out);
        else unpack_groups<f, false>(w, gstride, ng, k, out);
      }
      if constexpr (scales_ahead(f)) unpack_scales<f>(w, gstride, ng, k, (float*)(out + weight_bytes));
      return 0;
    });
  }
  return (const uint8_t*)buffer.data();
}

// Rows of one format, packed as kquant_gemm.cpp describes.
struct Segment {
  int fmt;
  int64_t rows;
  const uint8_t* w;
};

// The segments of weights w for n rows in format fmt (one, or TM_KQUANT_MIXED's); 0 if they do not add up.
int segments_of(int fmt, const uint8_t* w, int64_t n, Segment out[TM_KQUANT_MAX_SEGMENTS]) {
  if (fmt != TM_KQUANT_MIXED) {
    out[0] = {fmt, n, w};
    return 1;
  }
  int64_t header[1 + 3 * TM_KQUANT_MAX_SEGMENTS];
  memcpy(header, w, sizeof(header));
  const int64_t count = header[0];
  if (count < 1 || count > TM_KQUANT_MAX_SEGMENTS) return 0;
  int64_t rows = 0;
  for (int64_t s = 0; s < count; ++s) {
    const int64_t f = header[1 + 3 * s], r = header[2 + 3 * s], offset = header[3 + 3 * s];
    if (!source_block_bytes((int)f) || r <= 0 || offset < TM_KQUANT_HEADER_BYTES) return 0;
    // Every segment but the last fills whole groups of 16 rows: a group holds one format.
    if (s + 1 < count && r % G) return 0;
    out[s] = {(int)f, r, w + offset};
    rows += r;
  }
  return rows == n ? (int)count : 0;
}

int pack(int fmt, const uint8_t* src, int64_t n, int64_t k, uint8_t* out) {
  return with_kquant_format(fmt, -1, [&](auto F) { return pack_format<decltype(F)::value>(src, n, k, out); });
}

}  // namespace
