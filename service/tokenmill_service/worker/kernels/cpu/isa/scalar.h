// The scalar backend of simd.h: every op as a plain loop over its lanes. This is the definition of the
// native kernels' bits; the vector backends (avx2.h, avx512.h, neon.h) must give the same results, op
// for op, and the tests hold them to it. Built with -ffp-contract=off: a * b + c rounds twice here
// unless written as fmadd (std::fma, one rounding, what every vector FMA instruction does).
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "common.h"

namespace simd {

constexpr const char* ISA = "scalar";
// How many f32x16 a kernel's register tile may hold before it spills (tile sizes change speed, never bits).
constexpr int VECTOR_REGISTERS = 8;

struct f32x16 { float v[16]; };
struct i32x16 { int32_t v[16]; };
struct u8x64 { uint8_t v[64]; };

// -- float16 bits, exactly (IEEE binary16 round to nearest even, as F16C and ARM do; bfloat16's: common.h).

inline float half_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
  const uint32_t exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  if (exp == 0x1F) return bits_float(sign | 0x7F800000u | (man << 13) | (man ? 0x400000u : 0));  // inf, quiet NaN
  if (exp != 0) return bits_float(sign | ((exp + 112) << 23) | (man << 13));
  if (man == 0) return bits_float(sign);
  // Subnormal: man * 2^-24, exact in float32.
  const float mag = (float)man * 5.9604644775390625e-8f;
  return bits_float(sign | float_bits(mag));
}

inline uint16_t float_to_half(float f) {
  const uint32_t u = float_bits(f);
  const uint16_t sign = (uint16_t)((u >> 16) & 0x8000);
  const uint32_t abs = u & 0x7FFFFFFFu;
  if (abs > 0x7F800000u) return (uint16_t)(sign | 0x7E00 | ((abs >> 13) & 0x3FF));  // NaN, quieted
  if (abs >= 0x477FF000u) return (uint16_t)(sign | 0x7C00);  // rounds to infinity (>= 65520)
  if (abs >= 0x38800000u) {  // a normal half (>= 2^-14)
    const uint32_t rounded = abs + 0xFFFu + ((abs >> 13) & 1);  // to nearest, ties to even
    return (uint16_t)(sign | ((rounded - 0x38000000u) >> 13));
  }
  // Subnormal or zero: abs * 2^24 rounded to an integer of at most 10 bits (round to nearest even; the
  // product is exact, and rintf rounds ties to even in the default rounding mode).
  const float scaled = bits_float(abs) * 16777216.0f;
  return (uint16_t)(sign | (uint16_t)rintf(scaled));
}

// -- float lanes

inline f32x16 zero_f() { f32x16 r; for (int i = 0; i < 16; ++i) r.v[i] = 0.0f; return r; }
inline f32x16 set1(float x) { f32x16 r; for (int i = 0; i < 16; ++i) r.v[i] = x; return r; }
inline f32x16 load(const float* p) { f32x16 r; memcpy(r.v, p, 64); return r; }
inline void store(float* p, f32x16 a) { memcpy(p, a.v, 64); }
// Lanes outside m read as 0 and their memory is not touched (a load may end at a page's edge).
inline f32x16 load_masked(const float* p, lanes m) {
  f32x16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = (m >> i) & 1 ? p[i] : 0.0f;
  return r;
}
inline void store_masked(float* p, lanes m, f32x16 a) {
  for (int i = 0; i < 16; ++i) if ((m >> i) & 1) p[i] = a.v[i];
}
inline f32x16 load_half(const uint16_t* p) { f32x16 r; for (int i = 0; i < 16; ++i) r.v[i] = half_to_float(p[i]); return r; }
inline f32x16 load_bf16(const uint16_t* p) { f32x16 r; for (int i = 0; i < 16; ++i) r.v[i] = bf16_to_float(p[i]); return r; }
inline f32x16 load_bf16_masked(const uint16_t* p, lanes m) {
  f32x16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = (m >> i) & 1 ? bf16_to_float(p[i]) : 0.0f;
  return r;
}

#define TM_SIMD_F2(name, expr)                                   \
  inline f32x16 name(f32x16 a, f32x16 b) {                       \
    f32x16 r;                                                    \
    for (int i = 0; i < 16; ++i) { const float x = a.v[i], y = b.v[i]; r.v[i] = (expr); } \
    return r;                                                    \
  }
TM_SIMD_F2(add, x + y)
TM_SIMD_F2(sub, x - y)
TM_SIMD_F2(mul, x * y)
TM_SIMD_F2(div, x / y)
TM_SIMD_F2(max, x > y ? x : y)
TM_SIMD_F2(min, x < y ? x : y)
#undef TM_SIMD_F2

// select and select_i: lane i of a where bit i of m is set, else of b; less and equal_i: the lanes where
// a.v[i] op b.v[i].
#define TM_SIMD_SELECT(name, V)                                              \
  inline V name(lanes m, V a, V b) {                                         \
    V r;                                                                     \
    for (int i = 0; i < 16; ++i) r.v[i] = (m >> i) & 1 ? a.v[i] : b.v[i];    \
    return r;                                                                \
  }
#define TM_SIMD_MASK(name, V, op)                                                       \
  inline lanes name(V a, V b) {                                                         \
    lanes m = 0;                                                                        \
    for (int i = 0; i < 16; ++i) m |= (lanes)((a.v[i] op b.v[i] ? 1u : 0u) << i);       \
    return m;                                                                           \
  }

// a * b + c and c - a * b, each rounded once.
inline f32x16 fmadd(f32x16 a, f32x16 b, f32x16 c) {
  f32x16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = fmaf(a.v[i], b.v[i], c.v[i]);
  return r;
}
inline f32x16 fnmadd(f32x16 a, f32x16 b, f32x16 c) {
  f32x16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = fmaf(-a.v[i], b.v[i], c.v[i]);
  return r;
}
inline f32x16 abs(f32x16 a) {
  f32x16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = bits_float(float_bits(a.v[i]) & 0x7FFFFFFFu);
  return r;
}
// |mag| with the sign bit of sign.
inline f32x16 copy_sign(f32x16 mag, f32x16 sign) {
  f32x16 r;
  for (int i = 0; i < 16; ++i)
    r.v[i] = bits_float((float_bits(mag.v[i]) & 0x7FFFFFFFu) | (float_bits(sign.v[i]) & 0x80000000u));
  return r;
}
// To the nearest integer, ties to even (the default rounding mode, which the kernels never change).
inline f32x16 round_even(f32x16 a) {
  f32x16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = rintf(a.v[i]);
  return r;
}
// p * 2^n, n integer-valued in [-126, 127]: 2^n is a normal float, so this is one rounding.
inline f32x16 scale2(f32x16 p, f32x16 n) {
  f32x16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = p.v[i] * bits_float((uint32_t)((int32_t)n.v[i] + 127) << 23);
  return r;
}
TM_SIMD_SELECT(select, f32x16)
TM_SIMD_MASK(less, f32x16, <)
inline float lane0(f32x16 a) { return a.v[0]; }
// The bits of each lane as an int32, and back.
inline i32x16 as_bits(f32x16 a) { i32x16 r; memcpy(r.v, a.v, 64); return r; }
inline f32x16 from_bits(i32x16 a) { f32x16 r; memcpy(r.v, a.v, 64); return r; }

// The tree of simd.h: r[i] = op(x[i + h], x[i]) for h = 8, 4, 2, 1.
inline float reduce_add(f32x16 a) {
  float t[16];
  memcpy(t, a.v, 64);
  for (int h = 8; h >= 1; h /= 2)
    for (int i = 0; i < h; ++i) t[i] = t[i + h] + t[i];
  return t[0];
}
inline float reduce_max(f32x16 a) {
  float t[16];
  memcpy(t, a.v, 64);
  for (int h = 8; h >= 1; h /= 2)
    for (int i = 0; i < h; ++i) t[i] = t[i + h] > t[i] ? t[i + h] : t[i];
  return t[0];
}
// reduce_add of four vectors at once (the same four sums).
inline void reduce_add4(f32x16 a, f32x16 b, f32x16 c, f32x16 d, float out[4]) {
  out[0] = reduce_add(a);
  out[1] = reduce_add(b);
  out[2] = reduce_add(c);
  out[3] = reduce_add(d);
}

// -- int32 lanes

inline i32x16 zero_i() { i32x16 r; for (int i = 0; i < 16; ++i) r.v[i] = 0; return r; }
inline i32x16 set1_i(int32_t x) { i32x16 r; for (int i = 0; i < 16; ++i) r.v[i] = x; return r; }
inline i32x16 load_i(const int32_t* p) { i32x16 r; memcpy(r.v, p, 64); return r; }
inline i32x16 add_i(i32x16 a, i32x16 b) {
  i32x16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = (int32_t)((uint32_t)a.v[i] + (uint32_t)b.v[i]);
  return r;
}
inline i32x16 sub_i(i32x16 a, i32x16 b) {
  i32x16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = (int32_t)((uint32_t)a.v[i] - (uint32_t)b.v[i]);
  return r;
}
inline i32x16 shl_i(i32x16 a, int n) {
  i32x16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = (int32_t)((uint32_t)a.v[i] << n);
  return r;
}
// Logical: zeros shifted in.
inline i32x16 shr_i(i32x16 a, int n) {
  i32x16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = (int32_t)((uint32_t)a.v[i] >> n);
  return r;
}
inline i32x16 and_i(i32x16 a, i32x16 b) { i32x16 r; for (int i = 0; i < 16; ++i) r.v[i] = a.v[i] & b.v[i]; return r; }
inline i32x16 or_i(i32x16 a, i32x16 b) { i32x16 r; for (int i = 0; i < 16; ++i) r.v[i] = a.v[i] | b.v[i]; return r; }
inline i32x16 max_i(i32x16 a, i32x16 b) {
  i32x16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = a.v[i] > b.v[i] ? a.v[i] : b.v[i];
  return r;
}
TM_SIMD_SELECT(select_i, i32x16)
TM_SIMD_MASK(equal_i, i32x16, ==)
#undef TM_SIMD_SELECT
#undef TM_SIMD_MASK
// 16 bytes, zero- or sign-extended.
inline i32x16 load_u8_i(const uint8_t* p) { i32x16 r; for (int i = 0; i < 16; ++i) r.v[i] = p[i]; return r; }
inline i32x16 load_s8_i(const int8_t* p) { i32x16 r; for (int i = 0; i < 16; ++i) r.v[i] = p[i]; return r; }
// r[i] = table[idx[i] & 15].
inline i32x16 permute_i(i32x16 table, i32x16 idx) {
  i32x16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = table.v[idx.v[i] & 15];
  return r;
}
// Each lane clamped to [-128, 127].
inline i32x16 saturate_i8(i32x16 a) {
  i32x16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = a.v[i] < -128 ? -128 : a.v[i] > 127 ? 127 : a.v[i];
  return r;
}
// The low 8 or 16 bits of each lane.
inline void store_i8(int8_t* p, i32x16 a) { for (int i = 0; i < 16; ++i) p[i] = (int8_t)a.v[i]; }
inline void store_i16(int16_t* p, i32x16 a) { for (int i = 0; i < 16; ++i) p[i] = (int16_t)a.v[i]; }
inline int32_t reduce_add_i(i32x16 a) {
  uint32_t s = 0;
  for (int i = 0; i < 16; ++i) s += (uint32_t)a.v[i];
  return (int32_t)s;
}
inline f32x16 to_float(i32x16 a) { f32x16 r; for (int i = 0; i < 16; ++i) r.v[i] = (float)a.v[i]; return r; }
// To nearest, ties to even; NaN and values outside int32 give INT32_MIN (x86's "integer indefinite").
inline i32x16 to_int(f32x16 a) {
  i32x16 r;
  for (int i = 0; i < 16; ++i) {
    const float x = a.v[i];
    r.v[i] = x >= -2147483648.0f && x < 2147483648.0f ? (int32_t)rintf(x) : INT32_MIN;
  }
  return r;
}

// -- 64-byte vectors (bytes 4i .. 4i + 3 belong to lane i; 16-bit words 2i, 2i + 1 too)

inline u8x64 load_b(const void* p) { u8x64 r; memcpy(r.v, p, 64); return r; }
inline void store_b(void* p, u8x64 a) { memcpy(p, a.v, 64); }
inline u8x64 set1_b(uint8_t x) { u8x64 r; memset(r.v, x, 64); return r; }
inline u8x64 set1_w(uint16_t x) { u8x64 r; for (int i = 0; i < 32; ++i) memcpy(r.v + 2 * i, &x, 2); return r; }
inline u8x64 and_b(u8x64 a, u8x64 b) { u8x64 r; for (int i = 0; i < 64; ++i) r.v[i] = a.v[i] & b.v[i]; return r; }
inline u8x64 or_b(u8x64 a, u8x64 b) { u8x64 r; for (int i = 0; i < 64; ++i) r.v[i] = a.v[i] | b.v[i]; return r; }
// a | (b & c), bit by bit.
inline u8x64 or_and(u8x64 a, u8x64 b, u8x64 c) {
  u8x64 r;
  for (int i = 0; i < 64; ++i) r.v[i] = a.v[i] | (b.v[i] & c.v[i]);
  return r;
}
// Each 16-bit word (little-endian byte pair 2i, 2i + 1) shifted (op: >> or <<) by n in 0 .. 15, zeros shifted in.
#define TM_SIMD_SHIFT16(name, op)       \
  inline u8x64 name(u8x64 a, int n) {   \
    u8x64 r;                            \
    for (int i = 0; i < 32; ++i) {      \
      uint16_t w;                       \
      memcpy(&w, a.v + 2 * i, 2);       \
      w = (uint16_t)(w op n);           \
      memcpy(r.v + 2 * i, &w, 2);       \
    }                                   \
    return r;                           \
  }
TM_SIMD_SHIFT16(shr16, >>)
TM_SIMD_SHIFT16(shl16, <<)
#undef TM_SIMD_SHIFT16
// r[i] = table[idx[i]] for indices below 16.
inline u8x64 lookup16(const uint8_t* table, u8x64 idx) {
  u8x64 r;
  for (int i = 0; i < 64; ++i) r.v[i] = table[idx.v[i] & 15];
  return r;
}
// acc[i] += sum over j < 4 of u[4i + j] (unsigned) * s[j] (s: four signed bytes, s[j] = byte j of s4).
inline i32x16 dot_u8s8(i32x16 acc, u8x64 u, int32_t s4) {
  int8_t s[4];
  memcpy(s, &s4, 4);
  for (int i = 0; i < 16; ++i) {
    int32_t t = 0;
    for (int j = 0; j < 4; ++j) t += (int32_t)u.v[4 * i + j] * s[j];
    acc.v[i] = (int32_t)((uint32_t)acc.v[i] + (uint32_t)t);
  }
  return acc;
}
// dot_u8s8 for u below 128 (a backend may use a faster product there; the sums are the same).
inline i32x16 dot_u7s8(i32x16 acc, u8x64 u, int32_t s4) { return dot_u8s8(acc, u, s4); }
// acc[i] += w[2i] * a[0] + w[2i + 1] * a[1] for the int16 words w and a (a: two int16 in a2), wrapping.
inline i32x16 dot_s16(i32x16 acc, u8x64 w, int32_t a2) {
  int16_t a[2];
  memcpy(a, &a2, 4);
  for (int i = 0; i < 16; ++i) {
    int16_t x[2];
    memcpy(x, w.v + 4 * i, 4);
    const uint32_t t = (uint32_t)((int32_t)x[0] * a[0]) + (uint32_t)((int32_t)x[1] * a[1]);
    acc.v[i] = (int32_t)((uint32_t)acc.v[i] + t);
  }
  return acc;
}

}  // namespace simd
