// The ARM64 NEON backend of simd.h (ARMv8.2-A with the dot product: Graviton 2 and later, Ampere
// Altra, Apple M): each 16-lane vector is four 128-bit registers, lanes 4q .. 4q + 3 in v[q]. Same
// results as scalar.h, op for op; where ARM's instruction differs from x86's at the edges (max and
// min with NaN, float to int32 out of range) the x86 result is built, as scalar.h defines it.
#pragma once

#include <arm_neon.h>
#include <stdint.h>
#include <string.h>

#include "common.h"

#if !defined(__aarch64__) || !defined(__ARM_FEATURE_DOTPROD)
#error "the neon backend needs AArch64 with the dot product (-march=armv8.2-a+dotprod+fp16)"
#endif

namespace simd {

constexpr const char* ISA = "neon";
constexpr int VECTOR_REGISTERS = 8;  // v0-31, four a vector

struct f32x16 { float32x4_t v[4]; };
struct i32x16 { int32x4_t v[4]; };
struct u8x64 { uint8x16_t v[4]; };

inline float half_to_float(uint16_t h) {
  __fp16 x;
  memcpy(&x, &h, 2);
  return (float)x;
}
inline uint16_t float_to_half(float f) {
  const __fp16 x = (__fp16)f;  // FCVT: to nearest, ties to even
  uint16_t h;
  memcpy(&h, &x, 2);
  return h;
}

// Four lanes of a mask (bits 4q .. 4q + 3) as all-ones / all-zeros lanes.
inline uint32x4_t lane_mask4(lanes m, int q) {
  static const uint32_t bit[4] = {1, 2, 4, 8};
  return vtstq_u32(vdupq_n_u32((uint32_t)(m >> (4 * q)) & 15u), vld1q_u32(bit));
}

#define TM_FOR4(expr) \
  for (int q = 0; q < 4; ++q) { expr; }

// select and select_i (bsl: vbslq_f32 or vbslq_s32), and less and equal_i: the mask of the lanes where cmp
// (vcltq_f32, vceqq_s32) sets all ones, bits 4q .. 4q + 3 from register q.
#define TM_SIMD_SELECT(name, V, bsl)                                \
  inline V name(lanes m, V a, V b) {                                \
    V r;                                                            \
    TM_FOR4(r.v[q] = bsl(lane_mask4(m, q), a.v[q], b.v[q]));        \
    return r;                                                       \
  }
#define TM_SIMD_MASK(name, V, cmp)                                                                     \
  inline lanes name(V a, V b) {                                                                        \
    static const uint32_t bit[4] = {1, 2, 4, 8};                                                       \
    lanes m = 0;                                                                                       \
    TM_FOR4(m |= (lanes)(vaddvq_u32(vandq_u32(cmp(a.v[q], b.v[q]), vld1q_u32(bit))) << (4 * q)));     \
    return m;                                                                                          \
  }

// -- float lanes

inline f32x16 zero_f() { f32x16 r; TM_FOR4(r.v[q] = vdupq_n_f32(0.0f)); return r; }
inline f32x16 set1(float x) { f32x16 r; TM_FOR4(r.v[q] = vdupq_n_f32(x)); return r; }
inline f32x16 load(const float* p) { f32x16 r; TM_FOR4(r.v[q] = vld1q_f32(p + 4 * q)); return r; }
inline void store(float* p, f32x16 a) { TM_FOR4(vst1q_f32(p + 4 * q, a.v[q])); }
inline f32x16 load_masked(const float* p, lanes m) {
  if (m == 0xFFFF) return load(p);
  float t[16];
  for (int i = 0; i < 16; ++i) t[i] = (m >> i) & 1 ? p[i] : 0.0f;
  return load(t);
}
inline void store_masked(float* p, lanes m, f32x16 a) {
  if (m == 0xFFFF) return store(p, a);
  float t[16];
  store(t, a);
  for (int i = 0; i < 16; ++i) if ((m >> i) & 1) p[i] = t[i];
}
inline f32x16 load_half(const uint16_t* p) {
  f32x16 r;
  TM_FOR4(r.v[q] = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p + 4 * q))));
  return r;
}
inline f32x16 load_bf16(const uint16_t* p) {
  f32x16 r;
  TM_FOR4(r.v[q] = vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p + 4 * q), 16)));
  return r;
}
inline f32x16 load_bf16_masked(const uint16_t* p, lanes m) {
  if (m == 0xFFFF) return load_bf16(p);
  uint16_t t[16];
  for (int i = 0; i < 16; ++i) t[i] = (m >> i) & 1 ? p[i] : 0;
  return load_bf16(t);
}

inline f32x16 add(f32x16 a, f32x16 b) { f32x16 r; TM_FOR4(r.v[q] = vaddq_f32(a.v[q], b.v[q])); return r; }
inline f32x16 sub(f32x16 a, f32x16 b) { f32x16 r; TM_FOR4(r.v[q] = vsubq_f32(a.v[q], b.v[q])); return r; }
inline f32x16 mul(f32x16 a, f32x16 b) { f32x16 r; TM_FOR4(r.v[q] = vmulq_f32(a.v[q], b.v[q])); return r; }
inline f32x16 div(f32x16 a, f32x16 b) { f32x16 r; TM_FOR4(r.v[q] = vdivq_f32(a.v[q], b.v[q])); return r; }
// x86's: a where a > b, else b (so b where either is NaN; FMAX would return the NaN).
inline f32x16 max(f32x16 a, f32x16 b) {
  f32x16 r;
  TM_FOR4(r.v[q] = vbslq_f32(vcgtq_f32(a.v[q], b.v[q]), a.v[q], b.v[q]));
  return r;
}
inline f32x16 min(f32x16 a, f32x16 b) {
  f32x16 r;
  TM_FOR4(r.v[q] = vbslq_f32(vcltq_f32(a.v[q], b.v[q]), a.v[q], b.v[q]));
  return r;
}
inline f32x16 fmadd(f32x16 a, f32x16 b, f32x16 c) { f32x16 r; TM_FOR4(r.v[q] = vfmaq_f32(c.v[q], a.v[q], b.v[q])); return r; }
inline f32x16 fnmadd(f32x16 a, f32x16 b, f32x16 c) { f32x16 r; TM_FOR4(r.v[q] = vfmsq_f32(c.v[q], a.v[q], b.v[q])); return r; }
inline f32x16 abs(f32x16 a) { f32x16 r; TM_FOR4(r.v[q] = vabsq_f32(a.v[q])); return r; }
inline f32x16 copy_sign(f32x16 mag, f32x16 sign) {
  const uint32x4_t s = vdupq_n_u32(0x80000000u);
  f32x16 r;
  TM_FOR4(r.v[q] = vbslq_f32(s, sign.v[q], mag.v[q]));
  return r;
}
inline f32x16 round_even(f32x16 a) { f32x16 r; TM_FOR4(r.v[q] = vrndnq_f32(a.v[q])); return r; }
inline f32x16 scale2(f32x16 p, f32x16 n) {
  f32x16 r;
  TM_FOR4(r.v[q] = vmulq_f32(p.v[q], vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(vcvtnq_s32_f32(n.v[q]), vdupq_n_s32(127)), 23))));
  return r;
}
TM_SIMD_SELECT(select, f32x16, vbslq_f32)
TM_SIMD_MASK(less, f32x16, vcltq_f32)
inline float lane0(f32x16 a) { return vgetq_lane_f32(a.v[0], 0); }
inline i32x16 as_bits(f32x16 a) { i32x16 r; TM_FOR4(r.v[q] = vreinterpretq_s32_f32(a.v[q])); return r; }
inline f32x16 from_bits(i32x16 a) { f32x16 r; TM_FOR4(r.v[q] = vreinterpretq_f32_s32(a.v[q])); return r; }

// The tree of simd.h: lanes i + 8 (v[2], v[3]) onto i, then i + 4 (v[1]) onto i, then i + 2, i + 1.
inline float reduce_add(f32x16 a) {
  const float32x4_t s4 = vaddq_f32(vaddq_f32(a.v[3], a.v[1]), vaddq_f32(a.v[2], a.v[0]));
  const float32x2_t s2 = vadd_f32(vget_high_f32(s4), vget_low_f32(s4));
  return vget_lane_f32(s2, 1) + vget_lane_f32(s2, 0);
}
inline float32x4_t max4(float32x4_t a, float32x4_t b) { return vbslq_f32(vcgtq_f32(a, b), a, b); }
inline float reduce_max(f32x16 a) {
  const float32x4_t s4 = max4(max4(a.v[3], a.v[1]), max4(a.v[2], a.v[0]));
  const float32x2_t hi = vget_high_f32(s4), lo = vget_low_f32(s4);
  const float32x2_t s2 = vbsl_f32(vcgt_f32(hi, lo), hi, lo);
  const float x = vget_lane_f32(s2, 1), y = vget_lane_f32(s2, 0);
  return x > y ? x : y;
}
inline void reduce_add4(f32x16 a, f32x16 b, f32x16 c, f32x16 d, float out[4]) {
  out[0] = reduce_add(a);
  out[1] = reduce_add(b);
  out[2] = reduce_add(c);
  out[3] = reduce_add(d);
}

// -- int32 lanes

inline i32x16 zero_i() { i32x16 r; TM_FOR4(r.v[q] = vdupq_n_s32(0)); return r; }
inline i32x16 set1_i(int32_t x) { i32x16 r; TM_FOR4(r.v[q] = vdupq_n_s32(x)); return r; }
inline i32x16 load_i(const int32_t* p) { i32x16 r; TM_FOR4(r.v[q] = vld1q_s32(p + 4 * q)); return r; }
inline i32x16 add_i(i32x16 a, i32x16 b) { i32x16 r; TM_FOR4(r.v[q] = vaddq_s32(a.v[q], b.v[q])); return r; }
inline i32x16 sub_i(i32x16 a, i32x16 b) { i32x16 r; TM_FOR4(r.v[q] = vsubq_s32(a.v[q], b.v[q])); return r; }
inline i32x16 max_i(i32x16 a, i32x16 b) { i32x16 r; TM_FOR4(r.v[q] = vmaxq_s32(a.v[q], b.v[q])); return r; }
inline i32x16 shl_i(i32x16 a, int n) { i32x16 r; TM_FOR4(r.v[q] = vshlq_s32(a.v[q], vdupq_n_s32(n))); return r; }
inline i32x16 shr_i(i32x16 a, int n) {
  i32x16 r;
  TM_FOR4(r.v[q] = vreinterpretq_s32_u32(vshlq_u32(vreinterpretq_u32_s32(a.v[q]), vdupq_n_s32(-n))));
  return r;
}
inline i32x16 and_i(i32x16 a, i32x16 b) { i32x16 r; TM_FOR4(r.v[q] = vandq_s32(a.v[q], b.v[q])); return r; }
inline i32x16 or_i(i32x16 a, i32x16 b) { i32x16 r; TM_FOR4(r.v[q] = vorrq_s32(a.v[q], b.v[q])); return r; }
TM_SIMD_SELECT(select_i, i32x16, vbslq_s32)
TM_SIMD_MASK(equal_i, i32x16, vceqq_s32)
inline i32x16 load_u8_i(const uint8_t* p) {
  const uint8x16_t v = vld1q_u8(p);
  const uint16x8_t lo = vmovl_u8(vget_low_u8(v)), hi = vmovl_u8(vget_high_u8(v));
  return {{vreinterpretq_s32_u32(vmovl_u16(vget_low_u16(lo))), vreinterpretq_s32_u32(vmovl_u16(vget_high_u16(lo))),
           vreinterpretq_s32_u32(vmovl_u16(vget_low_u16(hi))), vreinterpretq_s32_u32(vmovl_u16(vget_high_u16(hi)))}};
}
inline i32x16 load_s8_i(const int8_t* p) {
  const int8x16_t v = vld1q_s8(p);
  const int16x8_t lo = vmovl_s8(vget_low_s8(v)), hi = vmovl_s8(vget_high_s8(v));
  return {{vmovl_s16(vget_low_s16(lo)), vmovl_s16(vget_high_s16(lo)), vmovl_s16(vget_low_s16(hi)), vmovl_s16(vget_high_s16(hi))}};
}
inline i32x16 permute_i(i32x16 table, i32x16 idx) {
  int32_t t[16], x[16], r[16];
  TM_FOR4(vst1q_s32(t + 4 * q, table.v[q]); vst1q_s32(x + 4 * q, idx.v[q]));
  for (int i = 0; i < 16; ++i) r[i] = t[x[i] & 15];
  return load_i(r);
}
inline i32x16 saturate_i8(i32x16 a) {
  i32x16 r;
  TM_FOR4(r.v[q] = vminq_s32(vmaxq_s32(a.v[q], vdupq_n_s32(-128)), vdupq_n_s32(127)));
  return r;
}
inline void store_i8(int8_t* p, i32x16 a) {
  const int16x8_t lo = vcombine_s16(vmovn_s32(a.v[0]), vmovn_s32(a.v[1]));
  const int16x8_t hi = vcombine_s16(vmovn_s32(a.v[2]), vmovn_s32(a.v[3]));
  vst1q_s8(p, vcombine_s8(vmovn_s16(lo), vmovn_s16(hi)));
}
inline void store_i16(int16_t* p, i32x16 a) { TM_FOR4(vst1_s16(p + 4 * q, vmovn_s32(a.v[q]))); }
inline int32_t reduce_add_i(i32x16 a) {
  return vaddvq_s32(vaddq_s32(vaddq_s32(a.v[0], a.v[1]), vaddq_s32(a.v[2], a.v[3])));
}
inline f32x16 to_float(i32x16 a) { f32x16 r; TM_FOR4(r.v[q] = vcvtq_f32_s32(a.v[q])); return r; }
// FCVTNS saturates and takes NaN to 0; x86 gives INT32_MIN for both: built here.
inline i32x16 to_int(f32x16 a) {
  i32x16 r;
  TM_FOR4(
      const uint32x4_t in = vandq_u32(vcgeq_f32(a.v[q], vdupq_n_f32(-2147483648.0f)), vcltq_f32(a.v[q], vdupq_n_f32(2147483648.0f)));
      r.v[q] = vbslq_s32(in, vcvtnq_s32_f32(a.v[q]), vdupq_n_s32(INT32_MIN)));
  return r;
}

// -- 64-byte vectors

inline u8x64 load_b(const void* p) { u8x64 r; TM_FOR4(r.v[q] = vld1q_u8((const uint8_t*)p + 16 * q)); return r; }
inline void store_b(void* p, u8x64 a) { TM_FOR4(vst1q_u8((uint8_t*)p + 16 * q, a.v[q])); }
inline u8x64 set1_b(uint8_t x) { u8x64 r; TM_FOR4(r.v[q] = vdupq_n_u8(x)); return r; }
inline u8x64 set1_w(uint16_t x) { u8x64 r; TM_FOR4(r.v[q] = vreinterpretq_u8_u16(vdupq_n_u16(x))); return r; }
inline u8x64 and_b(u8x64 a, u8x64 b) { u8x64 r; TM_FOR4(r.v[q] = vandq_u8(a.v[q], b.v[q])); return r; }
inline u8x64 or_b(u8x64 a, u8x64 b) { u8x64 r; TM_FOR4(r.v[q] = vorrq_u8(a.v[q], b.v[q])); return r; }
inline u8x64 or_and(u8x64 a, u8x64 b, u8x64 c) {
  u8x64 r;
  TM_FOR4(r.v[q] = vorrq_u8(a.v[q], vandq_u8(b.v[q], c.v[q])));
  return r;
}
inline u8x64 shr16(u8x64 a, int n) {
  u8x64 r;
  TM_FOR4(r.v[q] = vreinterpretq_u8_u16(vshlq_u16(vreinterpretq_u16_u8(a.v[q]), vdupq_n_s16((int16_t)-n))));
  return r;
}
inline u8x64 shl16(u8x64 a, int n) {
  u8x64 r;
  TM_FOR4(r.v[q] = vreinterpretq_u8_u16(vshlq_u16(vreinterpretq_u16_u8(a.v[q]), vdupq_n_s16((int16_t)n))));
  return r;
}
inline u8x64 lookup16(const uint8_t* table, u8x64 idx) {
  const uint8x16_t t = vld1q_u8(table);
  u8x64 r;
  TM_FOR4(r.v[q] = vqtbl1q_u8(t, idx.v[q]));
  return r;
}
// SDOT multiplies signed bytes: u - 128 is one, and sum (u - 128) s + 128 sum s is the same integer.
inline i32x16 dot_u8s8(i32x16 acc, u8x64 u, int32_t s4) {
  int8_t s[4];
  memcpy(s, &s4, 4);
  const int8x16_t sv = vreinterpretq_s8_s32(vdupq_n_s32(s4));
  const int32x4_t bias = vdupq_n_s32(128 * ((int32_t)s[0] + s[1] + s[2] + s[3]));
  const uint8x16_t flip = vdupq_n_u8(0x80);
  i32x16 r;
  TM_FOR4(r.v[q] = vaddq_s32(vdotq_s32(acc.v[q], vreinterpretq_s8_u8(veorq_u8(u.v[q], flip)), sv), bias));
  return r;
}
// u below 128 is the same value as a signed byte: one SDOT.
inline i32x16 dot_u7s8(i32x16 acc, u8x64 u, int32_t s4) {
  const int8x16_t sv = vreinterpretq_s8_s32(vdupq_n_s32(s4));
  i32x16 r;
  TM_FOR4(r.v[q] = vdotq_s32(acc.v[q], vreinterpretq_s8_u8(u.v[q]), sv));
  return r;
}
inline i32x16 dot_s16(i32x16 acc, u8x64 w, int32_t a2) {
  const int16x8_t a = vreinterpretq_s16_s32(vdupq_n_s32(a2));
  i32x16 r;
  TM_FOR4(
      const int16x8_t x = vreinterpretq_s16_u8(w.v[q]);
      const int32x4_t lo = vmull_s16(vget_low_s16(x), vget_low_s16(a));
      const int32x4_t hi = vmull_high_s16(x, a);
      r.v[q] = vaddq_s32(acc.v[q], vpaddq_s32(lo, hi)));
  return r;
}

#undef TM_SIMD_SELECT
#undef TM_SIMD_MASK
#undef TM_FOR4

}  // namespace simd
