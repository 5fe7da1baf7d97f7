// The AVX-512 backend of simd.h (F, BW, DQ, VL, VNNI; F16C): one 512-bit register per vector, each op
// one or two instructions. Same results as scalar.h, op for op.
#pragma once

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "common.h"

#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VNNI__) || !defined(__F16C__)
#error "the avx512 backend needs AVX-512F/BW, AVX-512 VNNI and F16C (-march=x86-64-v4 -mavx512vnni)"
#endif

namespace simd {

constexpr const char* ISA = "avx512";
constexpr int VECTOR_REGISTERS = 32;  // zmm0-31

struct f32x16 { __m512 v; };
struct i32x16 { __m512i v; };
struct u8x64 { __m512i v; };

inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }
inline uint16_t float_to_half(float f) { return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }

// -- float lanes

inline f32x16 zero_f() { return {_mm512_setzero_ps()}; }
inline f32x16 set1(float x) { return {_mm512_set1_ps(x)}; }
inline f32x16 load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void store(float* p, f32x16 a) { _mm512_storeu_ps(p, a.v); }
inline f32x16 load_masked(const float* p, lanes m) { return {_mm512_maskz_loadu_ps(m, p)}; }
inline void store_masked(float* p, lanes m, f32x16 a) { _mm512_mask_storeu_ps(p, m, a.v); }
inline f32x16 load_half(const uint16_t* p) { return {_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p))}; }
inline f32x16 load_bf16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256((const __m256i*)p);
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))};
}
inline f32x16 load_bf16_masked(const uint16_t* p, lanes m) {
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))};
}

inline f32x16 add(f32x16 a, f32x16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline f32x16 sub(f32x16 a, f32x16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline f32x16 mul(f32x16 a, f32x16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline f32x16 div(f32x16 a, f32x16 b) { return {_mm512_div_ps(a.v, b.v)}; }
inline f32x16 max(f32x16 a, f32x16 b) { return {_mm512_max_ps(a.v, b.v)}; }
inline f32x16 min(f32x16 a, f32x16 b) { return {_mm512_min_ps(a.v, b.v)}; }
inline f32x16 fmadd(f32x16 a, f32x16 b, f32x16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline f32x16 fnmadd(f32x16 a, f32x16 b, f32x16 c) { return {_mm512_fnmadd_ps(a.v, b.v, c.v)}; }
inline f32x16 abs(f32x16 a) { return {_mm512_abs_ps(a.v)}; }
inline f32x16 copy_sign(f32x16 mag, f32x16 sign) {
  // 0xCA: s ? sign : mag, bit by bit, with s the sign bit.
  const __m512i s = _mm512_set1_epi32((int)0x80000000u);
  return {_mm512_castsi512_ps(_mm512_ternarylogic_epi32(s, _mm512_castps_si512(sign.v), _mm512_castps_si512(mag.v), 0xCA))};
}
inline f32x16 round_even(f32x16 a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
inline f32x16 scale2(f32x16 p, f32x16 n) { return {_mm512_scalef_ps(p.v, n.v)}; }
inline f32x16 select(lanes m, f32x16 a, f32x16 b) { return {_mm512_mask_blend_ps(m, b.v, a.v)}; }
inline lanes less(f32x16 a, f32x16 b) { return _mm512_cmp_ps_mask(a.v, b.v, _CMP_LT_OQ); }
inline float lane0(f32x16 a) { return _mm512_cvtss_f32(a.v); }
inline i32x16 as_bits(f32x16 a) { return {_mm512_castps_si512(a.v)}; }
inline f32x16 from_bits(i32x16 a) { return {_mm512_castsi512_ps(a.v)}; }

// The tree of simd.h, step by step: halves, then quarters of the low half, then pairs.
inline __m128 fold_add(__m512 a) {
  const __m256 h = _mm256_add_ps(_mm512_extractf32x8_ps(a, 1), _mm512_castps512_ps256(a));
  const __m128 q = _mm_add_ps(_mm256_extractf128_ps(h, 1), _mm256_castps256_ps128(h));
  return _mm_add_ps(_mm_movehl_ps(q, q), q);
}
inline float reduce_add(f32x16 a) {
  const __m128 p = fold_add(a.v);
  return _mm_cvtss_f32(_mm_add_ss(_mm_movehdup_ps(p), p));
}
inline float reduce_max(f32x16 a) {
  const __m256 h = _mm256_max_ps(_mm512_extractf32x8_ps(a.v, 1), _mm512_castps512_ps256(a.v));
  const __m128 q = _mm_max_ps(_mm256_extractf128_ps(h, 1), _mm256_castps256_ps128(h));
  const __m128 p = _mm_max_ps(_mm_movehl_ps(q, q), q);
  return _mm_cvtss_f32(_mm_max_ss(_mm_movehdup_ps(p), p));
}
// Four trees side by side (the same sums as four reduce_add: lane i + 8, then + 4, + 2, + 1).
inline void reduce_add4(f32x16 a, f32x16 b, f32x16 c, f32x16 d, float out[4]) {
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a.v, b.v, _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(a.v, b.v, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c.v, d.v, _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(c.v, d.v, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 s = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 p = _mm512_add_ps(s, _mm512_permute_ps(s, _MM_SHUFFLE(1, 0, 3, 2)));
  const __m512 q = _mm512_add_ps(p, _mm512_permute_ps(p, _MM_SHUFFLE(2, 3, 0, 1)));
  _mm_storeu_ps(out, _mm512_castps512_ps128(
                         _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), q)));
}

// -- int32 lanes

inline i32x16 zero_i() { return {_mm512_setzero_si512()}; }
inline i32x16 set1_i(int32_t x) { return {_mm512_set1_epi32(x)}; }
inline i32x16 load_i(const int32_t* p) { return {_mm512_loadu_si512(p)}; }
inline i32x16 add_i(i32x16 a, i32x16 b) { return {_mm512_add_epi32(a.v, b.v)}; }
inline i32x16 sub_i(i32x16 a, i32x16 b) { return {_mm512_sub_epi32(a.v, b.v)}; }
inline i32x16 shl_i(i32x16 a, int n) { return {_mm512_slli_epi32(a.v, (unsigned)n)}; }
inline i32x16 shr_i(i32x16 a, int n) { return {_mm512_srli_epi32(a.v, (unsigned)n)}; }
inline i32x16 and_i(i32x16 a, i32x16 b) { return {_mm512_and_si512(a.v, b.v)}; }
inline i32x16 or_i(i32x16 a, i32x16 b) { return {_mm512_or_si512(a.v, b.v)}; }
inline i32x16 max_i(i32x16 a, i32x16 b) { return {_mm512_max_epi32(a.v, b.v)}; }
inline i32x16 select_i(lanes m, i32x16 a, i32x16 b) { return {_mm512_mask_blend_epi32(m, b.v, a.v)}; }
inline lanes equal_i(i32x16 a, i32x16 b) { return _mm512_cmpeq_epi32_mask(a.v, b.v); }
inline i32x16 load_u8_i(const uint8_t* p) { return {_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p))}; }
inline i32x16 load_s8_i(const int8_t* p) { return {_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p))}; }
inline i32x16 permute_i(i32x16 table, i32x16 idx) { return {_mm512_permutexvar_epi32(idx.v, table.v)}; }
inline i32x16 saturate_i8(i32x16 a) { return {_mm512_cvtepi8_epi32(_mm512_cvtsepi32_epi8(a.v))}; }
inline void store_i8(int8_t* p, i32x16 a) { _mm_storeu_si128((__m128i*)p, _mm512_cvtepi32_epi8(a.v)); }
inline void store_i16(int16_t* p, i32x16 a) { _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16(a.v)); }
inline int32_t reduce_add_i(i32x16 a) { return _mm512_reduce_add_epi32(a.v); }
inline f32x16 to_float(i32x16 a) { return {_mm512_cvtepi32_ps(a.v)}; }
inline i32x16 to_int(f32x16 a) { return {_mm512_cvtps_epi32(a.v)}; }

// -- 64-byte vectors

inline u8x64 load_b(const void* p) { return {_mm512_loadu_si512(p)}; }
inline void store_b(void* p, u8x64 a) { _mm512_storeu_si512(p, a.v); }
inline u8x64 set1_b(uint8_t x) { return {_mm512_set1_epi8((char)x)}; }
inline u8x64 set1_w(uint16_t x) { return {_mm512_set1_epi16((short)x)}; }
inline u8x64 and_b(u8x64 a, u8x64 b) { return {_mm512_and_si512(a.v, b.v)}; }
inline u8x64 or_b(u8x64 a, u8x64 b) { return {_mm512_or_si512(a.v, b.v)}; }
inline u8x64 or_and(u8x64 a, u8x64 b, u8x64 c) { return {_mm512_ternarylogic_epi32(a.v, b.v, c.v, 0xF8)}; }
inline u8x64 shr16(u8x64 a, int n) { return {_mm512_srli_epi16(a.v, (unsigned)n)}; }
inline u8x64 shl16(u8x64 a, int n) { return {_mm512_slli_epi16(a.v, (unsigned)n)}; }
inline u8x64 lookup16(const uint8_t* table, u8x64 idx) {
  return {_mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)table)), idx.v)};
}
inline i32x16 dot_u8s8(i32x16 acc, u8x64 u, int32_t s4) { return {_mm512_dpbusd_epi32(acc.v, u.v, _mm512_set1_epi32(s4))}; }
inline i32x16 dot_u7s8(i32x16 acc, u8x64 u, int32_t s4) { return dot_u8s8(acc, u, s4); }
inline i32x16 dot_s16(i32x16 acc, u8x64 w, int32_t a2) { return {_mm512_dpwssd_epi32(acc.v, w.v, _mm512_set1_epi32(a2))}; }

}  // namespace simd
