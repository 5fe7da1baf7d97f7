// The block formats (Q4_0 ... MXFP4) as vnni_gemm.cpp's tiles read them: the formats' facts, a source block
// unpacked, and the packing into groups of 16 rows (the layout: vnni_gemm.cpp's head). Included by
// vnni_gemm.cpp alone; kept apart so that the products' file holds the products.
#pragma once

#include "tm_abi.h"       // the block formats (generated from abi.py)
#include "vnni_common.h"  // the groups, the planes' layout

namespace {

using namespace simd;
using vnni::dword_at;
using vnni::G;
using vnni::half_bits;
using vnni::put_planes;
using vnni::QK;
using vnni::total;
using vnni::quantize_row;

// IQ4_NL's 16 levels (ggml's kvalues_iq4nl) + 128: the unsigned q the product takes.
alignas(16) constexpr uint8_t IQ4_Q[16] = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};
// MXFP4's e2m1 values doubled (ggml's kvalues_mxfp4: 0, 1, 2, 3, 4, 6, 8, 12 and their negatives) + 128.
alignas(16) constexpr uint8_t MXFP4_Q[16] = {128, 129, 130, 131, 132, 134, 136, 140,
                                             128, 127, 126, 125, 124, 122, 120, 116};

// The native formats but F32 (block_gemm.cpp's alone); 0 for any other.
int64_t source_block_bytes(int fmt) { return fmt == F32 ? 0 : tm_native_block_bytes(fmt); }

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

// The formats this file packs, and one call of f(std::integral_constant<int, F>{}) for fmt's F.
template <class Fn>
int with_vnni_format(int fmt, int otherwise, Fn&& f) {
  return vnni::with_format<Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, MXFP4>(fmt, otherwise, f);
}

int pack(int fmt, const uint8_t* src, int64_t n, int64_t k, uint8_t* out) {
  return with_vnni_format(fmt, -1, [&](auto F) { return pack_format<decltype(F)::value>(src, n, k, out); });
}

}  // namespace
