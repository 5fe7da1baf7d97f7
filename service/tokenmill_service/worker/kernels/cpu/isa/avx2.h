// The AVX2 backend of simd.h (AVX2, FMA, F16C: x86-64-v3, every x86 server CPU since 2013): each
// 16-lane vector is two 256-bit registers, lanes 0-7 in v[0] and 8-15 in v[1]. Same results as
// scalar.h, op for op.
#pragma once

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "common.h"

#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "the avx2 backend needs AVX2, FMA and F16C (-march=x86-64-v3)"
#endif

namespace simd {

#if defined(TM_ISA_AVX2VNNI)
#if !defined(__AVXVNNI__)
#error "the avx2vnni backend needs AVX-VNNI (-mavxvnni)"
#endif
constexpr const char* ISA = "avx2vnni";
#else
constexpr const char* ISA = "avx2";
#endif
constexpr int VECTOR_REGISTERS = 8;  // ymm0-15, two a vector

struct f32x16 { __m256 v[2]; };
struct i32x16 { __m256i v[2]; };
struct u8x64 { __m256i v[2]; };

inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }
inline uint16_t float_to_half(float f) { return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }

// Eight lanes of a mask as all-ones / all-zeros int32 lanes.
inline __m256i lane_mask8(unsigned bits) {
  const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)bits), bit), bit);
}

#define TM_SIMD_F2(name, op) \
  inline f32x16 name(f32x16 a, f32x16 b) { return {{op(a.v[0], b.v[0]), op(a.v[1], b.v[1])}}; }
#define TM_SIMD_F3(name, op)                                                   \
  inline f32x16 name(f32x16 a, f32x16 b, f32x16 c) {                           \
    return {{op(a.v[0], b.v[0], c.v[0]), op(a.v[1], b.v[1], c.v[1])}};         \
  }
#define TM_SIMD_I2(name, op) \
  inline i32x16 name(i32x16 a, i32x16 b) { return {{op(a.v[0], b.v[0]), op(a.v[1], b.v[1])}}; }
#define TM_SIMD_B2(name, op) \
  inline u8x64 name(u8x64 a, u8x64 b) { return {{op(a.v[0], b.v[0]), op(a.v[1], b.v[1])}}; }

// -- float lanes

inline f32x16 zero_f() { return {{_mm256_setzero_ps(), _mm256_setzero_ps()}}; }
inline f32x16 set1(float x) { return {{_mm256_set1_ps(x), _mm256_set1_ps(x)}}; }
inline f32x16 load(const float* p) { return {{_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}}; }
inline void store(float* p, f32x16 a) {
  _mm256_storeu_ps(p, a.v[0]);
  _mm256_storeu_ps(p + 8, a.v[1]);
}
inline f32x16 load_masked(const float* p, lanes m) {
  if (m == 0xFFFF) return load(p);
  return {{_mm256_maskload_ps(p, lane_mask8(m & 0xFF)), _mm256_maskload_ps(p + 8, lane_mask8(m >> 8))}};
}
inline void store_masked(float* p, lanes m, f32x16 a) {
  if (m == 0xFFFF) return store(p, a);
  _mm256_maskstore_ps(p, lane_mask8(m & 0xFF), a.v[0]);
  _mm256_maskstore_ps(p + 8, lane_mask8(m >> 8), a.v[1]);
}
inline f32x16 load_half(const uint16_t* p) {
  return {{_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 8)))}};
}
inline __m256 bf16x8(__m128i h) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); }
inline f32x16 load_bf16(const uint16_t* p) {
  return {{bf16x8(_mm_loadu_si128((const __m128i*)p)), bf16x8(_mm_loadu_si128((const __m128i*)(p + 8)))}};
}
inline f32x16 load_bf16_masked(const uint16_t* p, lanes m) {
  if (m == 0xFFFF) return load_bf16(p);
  alignas(32) uint16_t t[16];
  for (int i = 0; i < 16; ++i) t[i] = (m >> i) & 1 ? p[i] : 0;
  return load_bf16(t);
}

TM_SIMD_F2(add, _mm256_add_ps)
TM_SIMD_F2(sub, _mm256_sub_ps)
TM_SIMD_F2(mul, _mm256_mul_ps)
TM_SIMD_F2(div, _mm256_div_ps)
TM_SIMD_F2(max, _mm256_max_ps)
TM_SIMD_F2(min, _mm256_min_ps)
TM_SIMD_F3(fmadd, _mm256_fmadd_ps)
TM_SIMD_F3(fnmadd, _mm256_fnmadd_ps)

inline f32x16 abs(f32x16 a) {
  const __m256 m = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  return {{_mm256_and_ps(a.v[0], m), _mm256_and_ps(a.v[1], m)}};
}
inline f32x16 copy_sign(f32x16 mag, f32x16 sign) {
  const __m256 s = _mm256_castsi256_ps(_mm256_set1_epi32((int)0x80000000u));
  return {{_mm256_or_ps(_mm256_andnot_ps(s, mag.v[0]), _mm256_and_ps(s, sign.v[0])),
           _mm256_or_ps(_mm256_andnot_ps(s, mag.v[1]), _mm256_and_ps(s, sign.v[1]))}};
}
inline f32x16 round_even(f32x16 a) {
  constexpr int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {{_mm256_round_ps(a.v[0], mode), _mm256_round_ps(a.v[1], mode)}};
}
// 2^n built from its exponent bits (n in [-126, 127]: a normal float), then one multiply.
inline __m256 pow2(__m256 n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline f32x16 scale2(f32x16 p, f32x16 n) {
  return {{_mm256_mul_ps(p.v[0], pow2(n.v[0])), _mm256_mul_ps(p.v[1], pow2(n.v[1]))}};
}
inline f32x16 select(lanes m, f32x16 a, f32x16 b) {
  return {{_mm256_blendv_ps(b.v[0], a.v[0], _mm256_castsi256_ps(lane_mask8(m & 0xFF))),
           _mm256_blendv_ps(b.v[1], a.v[1], _mm256_castsi256_ps(lane_mask8(m >> 8)))}};
}
inline lanes less(f32x16 a, f32x16 b) {
  const int lo = _mm256_movemask_ps(_mm256_cmp_ps(a.v[0], b.v[0], _CMP_LT_OQ));
  const int hi = _mm256_movemask_ps(_mm256_cmp_ps(a.v[1], b.v[1], _CMP_LT_OQ));
  return (lanes)(lo | hi << 8);
}
inline float lane0(f32x16 a) { return _mm256_cvtss_f32(a.v[0]); }
inline i32x16 as_bits(f32x16 a) { return {{_mm256_castps_si256(a.v[0]), _mm256_castps_si256(a.v[1])}}; }
inline f32x16 from_bits(i32x16 a) { return {{_mm256_castsi256_ps(a.v[0]), _mm256_castsi256_ps(a.v[1])}}; }

inline float reduce_add(f32x16 a) {
  const __m256 h = _mm256_add_ps(a.v[1], a.v[0]);
  const __m128 q = _mm_add_ps(_mm256_extractf128_ps(h, 1), _mm256_castps256_ps128(h));
  const __m128 p = _mm_add_ps(_mm_movehl_ps(q, q), q);
  return _mm_cvtss_f32(_mm_add_ss(_mm_movehdup_ps(p), p));
}
inline float reduce_max(f32x16 a) {
  const __m256 h = _mm256_max_ps(a.v[1], a.v[0]);
  const __m128 q = _mm_max_ps(_mm256_extractf128_ps(h, 1), _mm256_castps256_ps128(h));
  const __m128 p = _mm_max_ps(_mm_movehl_ps(q, q), q);
  return _mm_cvtss_f32(_mm_max_ss(_mm_movehdup_ps(p), p));
}
inline void reduce_add4(f32x16 a, f32x16 b, f32x16 c, f32x16 d, float out[4]) {
  out[0] = reduce_add(a);
  out[1] = reduce_add(b);
  out[2] = reduce_add(c);
  out[3] = reduce_add(d);
}

// -- int32 lanes

inline i32x16 zero_i() { return {{_mm256_setzero_si256(), _mm256_setzero_si256()}}; }
inline i32x16 set1_i(int32_t x) { return {{_mm256_set1_epi32(x), _mm256_set1_epi32(x)}}; }
inline i32x16 load_i(const int32_t* p) {
  return {{_mm256_loadu_si256((const __m256i*)p), _mm256_loadu_si256((const __m256i*)(p + 8))}};
}
TM_SIMD_I2(add_i, _mm256_add_epi32)
TM_SIMD_I2(sub_i, _mm256_sub_epi32)
TM_SIMD_I2(max_i, _mm256_max_epi32)
inline i32x16 shl_i(i32x16 a, int n) { return {{_mm256_slli_epi32(a.v[0], n), _mm256_slli_epi32(a.v[1], n)}}; }
inline i32x16 shr_i(i32x16 a, int n) { return {{_mm256_srli_epi32(a.v[0], n), _mm256_srli_epi32(a.v[1], n)}}; }
TM_SIMD_I2(and_i, _mm256_and_si256)
TM_SIMD_I2(or_i, _mm256_or_si256)
inline i32x16 select_i(lanes m, i32x16 a, i32x16 b) {
  return {{_mm256_blendv_epi8(b.v[0], a.v[0], lane_mask8(m & 0xFF)), _mm256_blendv_epi8(b.v[1], a.v[1], lane_mask8(m >> 8))}};
}
inline lanes equal_i(i32x16 a, i32x16 b) {
  const int lo = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(a.v[0], b.v[0])));
  const int hi = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(a.v[1], b.v[1])));
  return (lanes)(lo | hi << 8);
}
inline i32x16 load_u8_i(const uint8_t* p) {
  const __m128i v = _mm_loadu_si128((const __m128i*)p);
  return {{_mm256_cvtepu8_epi32(v), _mm256_cvtepu8_epi32(_mm_srli_si128(v, 8))}};
}
inline i32x16 load_s8_i(const int8_t* p) {
  const __m128i v = _mm_loadu_si128((const __m128i*)p);
  return {{_mm256_cvtepi8_epi32(v), _mm256_cvtepi8_epi32(_mm_srli_si128(v, 8))}};
}
// table[idx & 15]: each half of the table looked up by the low three bits, the fourth bit choosing.
inline __m256i permute8(i32x16 table, __m256i idx) {
  const __m256i lo = _mm256_permutevar8x32_epi32(table.v[0], idx);
  const __m256i hi = _mm256_permutevar8x32_epi32(table.v[1], idx);
  const __m256i upper = _mm256_cmpeq_epi32(_mm256_and_si256(idx, _mm256_set1_epi32(8)), _mm256_set1_epi32(8));
  return _mm256_blendv_epi8(lo, hi, upper);
}
inline i32x16 permute_i(i32x16 table, i32x16 idx) { return {{permute8(table, idx.v[0]), permute8(table, idx.v[1])}}; }
inline i32x16 saturate_i8(i32x16 a) {
  const __m256i lo = _mm256_set1_epi32(-128), hi = _mm256_set1_epi32(127);
  return {{_mm256_min_epi32(_mm256_max_epi32(a.v[0], lo), hi), _mm256_min_epi32(_mm256_max_epi32(a.v[1], lo), hi)}};
}
inline void store_i8(int8_t* p, i32x16 a) {
  alignas(32) int32_t t[16];
  _mm256_store_si256((__m256i*)t, a.v[0]);
  _mm256_store_si256((__m256i*)(t + 8), a.v[1]);
  for (int i = 0; i < 16; ++i) p[i] = (int8_t)t[i];
}
inline void store_i16(int16_t* p, i32x16 a) {
  alignas(32) int32_t t[16];
  _mm256_store_si256((__m256i*)t, a.v[0]);
  _mm256_store_si256((__m256i*)(t + 8), a.v[1]);
  for (int i = 0; i < 16; ++i) p[i] = (int16_t)t[i];
}
inline int32_t reduce_add_i(i32x16 a) {
  const __m256i h = _mm256_add_epi32(a.v[0], a.v[1]);
  __m128i q = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
  q = _mm_add_epi32(q, _mm_shuffle_epi32(q, _MM_SHUFFLE(1, 0, 3, 2)));
  q = _mm_add_epi32(q, _mm_shuffle_epi32(q, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(q);
}
inline f32x16 to_float(i32x16 a) { return {{_mm256_cvtepi32_ps(a.v[0]), _mm256_cvtepi32_ps(a.v[1])}}; }
inline i32x16 to_int(f32x16 a) { return {{_mm256_cvtps_epi32(a.v[0]), _mm256_cvtps_epi32(a.v[1])}}; }

// -- 64-byte vectors

inline u8x64 load_b(const void* p) {
  return {{_mm256_loadu_si256((const __m256i*)p), _mm256_loadu_si256((const __m256i*)((const uint8_t*)p + 32))}};
}
inline void store_b(void* p, u8x64 a) {
  _mm256_storeu_si256((__m256i*)p, a.v[0]);
  _mm256_storeu_si256((__m256i*)((uint8_t*)p + 32), a.v[1]);
}
inline u8x64 set1_b(uint8_t x) { return {{_mm256_set1_epi8((char)x), _mm256_set1_epi8((char)x)}}; }
inline u8x64 set1_w(uint16_t x) { return {{_mm256_set1_epi16((short)x), _mm256_set1_epi16((short)x)}}; }
TM_SIMD_B2(and_b, _mm256_and_si256)
TM_SIMD_B2(or_b, _mm256_or_si256)
inline u8x64 or_and(u8x64 a, u8x64 b, u8x64 c) {
  return {{_mm256_or_si256(a.v[0], _mm256_and_si256(b.v[0], c.v[0])), _mm256_or_si256(a.v[1], _mm256_and_si256(b.v[1], c.v[1]))}};
}
inline u8x64 shr16(u8x64 a, int n) { return {{_mm256_srli_epi16(a.v[0], n), _mm256_srli_epi16(a.v[1], n)}}; }
inline u8x64 shl16(u8x64 a, int n) { return {{_mm256_slli_epi16(a.v[0], n), _mm256_slli_epi16(a.v[1], n)}}; }
inline u8x64 lookup16(const uint8_t* table, u8x64 idx) {
  const __m256i t = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)table));
  return {{_mm256_shuffle_epi8(t, idx.v[0]), _mm256_shuffle_epi8(t, idx.v[1])}};
}
// A product's sums as they are, in their registers: an empty asm that GCC must assume changes them. Without it
// GCC 12 reassociates a tile's chain of vpaddd (integer adds: any order is the same sum) across its unrolled
// steps, computing every product first and spilling them to the stack: measured on an AMD EPYC (Zen 4, one
// thread, in cache), the words' Q4_K tile 1.6 times as fast with it, Q6_K 1.3, the int8 activations' 1.1-1.15.
inline i32x16 kept(i32x16 r) {
  __asm__("" : "+x"(r.v[0]), "+x"(r.v[1]));
  return r;
}
#if defined(TM_ISA_AVX2VNNI)
// AVX-VNNI (-mavxvnni): vpdpbusd and vpdpwssd on 256-bit registers, each product one instruction into its int32
// sum, as AVX-512's: exact, the sums wrapping as the scalar definition's int32 does.
inline i32x16 dot_u8s8(i32x16 acc, u8x64 u, int32_t s4) {
  const __m256i s = _mm256_set1_epi32(s4);
  return kept({{_mm256_dpbusd_avx_epi32(acc.v[0], u.v[0], s), _mm256_dpbusd_avx_epi32(acc.v[1], u.v[1], s)}});
}
inline i32x16 dot_u7s8(i32x16 acc, u8x64 u, int32_t s4) { return dot_u8s8(acc, u, s4); }
inline i32x16 dot_s16(i32x16 acc, u8x64 w, int32_t a2) {
  const __m256i a = _mm256_set1_epi32(a2);
  return kept({{_mm256_dpwssd_avx_epi32(acc.v[0], w.v[0], a), _mm256_dpwssd_avx_epi32(acc.v[1], w.v[1], a)}});
}
#else
// Exact for every byte: the even and the odd bytes of each dword as int16 words, two vpmaddwd (an
// unsigned byte times a signed one needs 16 bits, and vpmaddubsw's saturating pair sums would not hold
// 255 * -128 twice).
inline i32x16 dot_u8s8(i32x16 acc, u8x64 u, int32_t s4) {
  int8_t s[4];
  memcpy(s, &s4, 4);
  const __m256i even = _mm256_set1_epi32((int32_t)(uint16_t)(int16_t)s[0] | (int32_t)((uint32_t)(uint16_t)(int16_t)s[2] << 16));
  const __m256i odd = _mm256_set1_epi32((int32_t)(uint16_t)(int16_t)s[1] | (int32_t)((uint32_t)(uint16_t)(int16_t)s[3] << 16));
  const __m256i low = _mm256_set1_epi16(0x00FF);
  i32x16 r;
  for (int h = 0; h < 2; ++h) {
    const __m256i e = _mm256_madd_epi16(_mm256_and_si256(u.v[h], low), even);
    const __m256i o = _mm256_madd_epi16(_mm256_srli_epi16(u.v[h], 8), odd);
    r.v[h] = _mm256_add_epi32(acc.v[h], _mm256_add_epi32(e, o));
  }
  return kept(r);
}
// u below 128: vpmaddubsw's pair sums (at most 2 * 127 * 128) cannot saturate; vpmaddwd by ones adds the pairs.
inline i32x16 dot_u7s8(i32x16 acc, u8x64 u, int32_t s4) {
  const __m256i s = _mm256_set1_epi32(s4), ones = _mm256_set1_epi16(1);
  return kept({{_mm256_add_epi32(acc.v[0], _mm256_madd_epi16(_mm256_maddubs_epi16(u.v[0], s), ones)),
                _mm256_add_epi32(acc.v[1], _mm256_madd_epi16(_mm256_maddubs_epi16(u.v[1], s), ones))}});
}
// Pair sums in 16 bits (simd.h's pairs16): vpmaddubsw's pairs added as words, without dot_u7s8's vpmaddwd by ones
// and vpaddd each product; add_pairs widens them once for many products (2 multiply-pipe instructions a
// product's register rather than 4 over a Q4_K block of 32).
#define TM_SIMD_PAIR_SUMS 1
constexpr bool PAIR_SUMS = true;
struct pairs16 { __m256i v[2]; };
inline pairs16 zero_pairs() { return {{_mm256_setzero_si256(), _mm256_setzero_si256()}}; }
inline pairs16 dot_u7s8_pairs(pairs16 p, u8x64 u, int32_t s4) {
  const __m256i s = _mm256_set1_epi32(s4);
  pairs16 r{{_mm256_add_epi16(p.v[0], _mm256_maddubs_epi16(u.v[0], s)), _mm256_add_epi16(p.v[1], _mm256_maddubs_epi16(u.v[1], s))}};
  __asm__("" : "+x"(r.v[0]), "+x"(r.v[1]));  // as kept(): the sums stay in their registers
  return r;
}
inline i32x16 add_pairs(i32x16 acc, pairs16 p) {
  const __m256i ones = _mm256_set1_epi16(1);
  return kept({{_mm256_add_epi32(acc.v[0], _mm256_madd_epi16(p.v[0], ones)), _mm256_add_epi32(acc.v[1], _mm256_madd_epi16(p.v[1], ones))}});
}
inline i32x16 dot_s16(i32x16 acc, u8x64 w, int32_t a2) {
  const __m256i a = _mm256_set1_epi32(a2);
  return kept({{_mm256_add_epi32(acc.v[0], _mm256_madd_epi16(w.v[0], a)), _mm256_add_epi32(acc.v[1], _mm256_madd_epi16(w.v[1], a))}});
}
#endif

#undef TM_SIMD_F2
#undef TM_SIMD_F3
#undef TM_SIMD_I2
#undef TM_SIMD_B2

}  // namespace simd
