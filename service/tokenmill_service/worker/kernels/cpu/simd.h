// The one vector language every native kernel is written in: 16 lanes, whatever the CPU.
//
// A kernel says what each of 16 float32 (f32x16) or int32 (i32x16) lanes computes, and 64-byte
// vectors (u8x64) whose bytes 4i .. 4i + 3 belong to lane i; which instructions carry it out is the
// backend's business, picked at build time by one macro (build.py compiles each kernel once per
// instruction set):
//
//   TM_ISA_SCALAR  isa/scalar.h   plain C++, a loop over the lanes: THE DEFINITION of every op's bits
//   TM_ISA_AVX2    isa/avx2.h     AVX2 + FMA + F16C: two 8-lane registers per vector
//   TM_ISA_AVX2VNNI isa/avx2.h    the same with AVX-VNNI's vpdpbusd / vpdpwssd for the integer products (Intel's
//                                 cores since Alder Lake that lack AVX-512, and its E-core Xeons)
//   TM_ISA_AVX512  isa/avx512.h   AVX-512 F/BW/DQ/VL + VNNI: one register per vector
//   TM_ISA_NEON    isa/neon.h     ARMv8.2 NEON with the dot product: four 4-lane registers per vector
//
// (isa/common.h: what they all have alike, the lane mask's type and the bit casts.)
//
// Every op is elementwise or has one fixed order (the reductions below), every float op rounds once
// (fmadd and fnmadd are fused, nothing else is: kernels are built with -ffp-contract=off), and the
// integer products are exact, so a kernel written in these ops gives the same bits on every backend:
// the scalar build defines them, and tests hold each instruction set's build to it.
//
// The reductions (reduce_add, reduce_max): a tree over the lanes, r[i] = op(x[i + h], x[i]) for
// h = 8, 4, 2, 1 (the order GCC's _mm512_reduce_add_ps takes).
// max(a, b) and min(a, b) are x86's: a > b ? a : b and a < b ? a : b (b where either is NaN).
// to_int rounds to nearest, ties to even; NaN and values outside int32 give INT32_MIN (x86's).
// scale2(p, n) is p * 2^n for integer-valued n in [-126, 127] (2^n a normal float: one rounding).
// lookup16 takes indices below 16 only; dot_u7s8 weights below 128 only (each backend may use a
// faster product there); the other integer ops are exact for every input, wrapping as int32 does.
#pragma once

#include <stdint.h>
#include <string.h>

// Which backend; the build passes one (a kernel built with none is the scalar definition).
#if defined(TM_ISA_AVX512)
#include "isa/avx512.h"
#elif defined(TM_ISA_AVX2VNNI)
#define TM_ISA_AVX2 1  // AVX2's backend and tiles, its integer products fused (isa/avx2.h)
#include "isa/avx2.h"
#elif defined(TM_ISA_AVX2)
#include "isa/avx2.h"
#elif defined(TM_ISA_NEON)
#include "isa/neon.h"
#else
#ifndef TM_ISA_SCALAR
#define TM_ISA_SCALAR 1
#endif
#include "isa/scalar.h"
#endif

namespace simd {

// Lanes [0, n) of 16 (n clamped to 0 .. 16).
inline lanes first_lanes(int64_t n) {
  return n >= 16 ? (lanes)0xFFFF : n <= 0 ? (lanes)0 : (lanes)((1u << n) - 1);
}

// Asks for the cache line at p in L2 ahead of its use (prefetcht1 on x86, PRFM PLDL2KEEP on ARM);
// a prefetch never faults, whatever p is.
inline void prefetch_l2(const void* p) { __builtin_prefetch(p, 0, 2); }

// ((c0 x + c1) x + c2) x + ... by Horner's rule: one fmadd a coefficient after c0, in that order (the bits follow
// it). Always inlined: the same code as the chain written out.
template <class... C>
__attribute__((always_inline)) inline f32x16 horner(f32x16 x, float c0, C... c) {
  f32x16 p = set1(c0);
  ((p = fmadd(p, x, set1(c))), ...);
  return p;
}

// e^x for every lane, |x| clamped to [-87, 88]: 2^n * e^r with n = round(x / ln 2) and a degree-6
// polynomial for e^r, |r| <= ln(2) / 2 (Cephes' expf coefficients, ~1 ulp).
inline f32x16 exp(f32x16 x) {
  x = min(max(x, set1(-87.0f)), set1(88.0f));
  const f32x16 n = round_even(mul(x, set1(1.44269504088896341f)));
  f32x16 r = fnmadd(n, set1(0.693359375f), x);
  r = fnmadd(n, set1(-2.12194440e-4f), r);
  f32x16 p = horner(r, 1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f,
                     5.0000001201e-1f);
  p = fmadd(p, mul(r, r), add(r, set1(1.0f)));
  return scale2(p, n);
}

// 2^x for x <= 0 (a softmax's score minus its maximum, in base 2), clamped at -125 so that the result
// stays a normal float: 2^n times 2^f with n = round(x), f = x - n in [-1/2, 1/2], 2^f a degree-6
// polynomial fit for relative error (~1e-7).
inline f32x16 exp2_nonpositive(f32x16 x) {
  x = max(x, set1(-125.0f));
  const f32x16 n = round_even(x);
  const f32x16 f = sub(x, n);
  const f32x16 p = horner(f, 1.5337577497e-4f, 1.3399859890e-3f, 9.6185198054e-3f, 5.5503290147e-2f, 2.4022646248e-1f,
                          6.9314718246e-1f, 1.0f);
  return scale2(p, n);
}

// tanh(x) for every lane: Cephes' tanhf, an odd polynomial up to |x| = 0.625 and 1 - 2 / (e^(2|x|) + 1)
// above it, with the sign of x (NaN stays NaN).
inline f32x16 tanh(f32x16 x) {
  const f32x16 ax = abs(x);
  const f32x16 z = mul(x, x);
  const f32x16 p = horner(z, -5.70498872745e-3f, 2.06390887954e-2f, -5.37397155531e-2f, 1.33314422036e-1f,
                          -3.33332819422e-1f);
  const f32x16 small = fmadd(mul(p, z), x, x);
  const f32x16 e = exp(add(ax, ax));
  const f32x16 big = sub(set1(1.0f), div(set1(2.0f), add(e, set1(1.0f))));
  // 0.625 < |x| is false for NaN: it takes the polynomial's side, which keeps it NaN.
  return select(less(set1(0.625f), ax), copy_sign(big, x), small);
}

// ln(x) for positive normal x (a softmax's sum: at least 1; other lanes' results are unspecified): x = 2^e m
// with m in [sqrt(1/2), sqrt(2)), ln(1 + f) for f = m - 1 (exact) by Cephes' logf polynomial (~1 ulp), and
// e ln 2 in two parts.
inline f32x16 log(f32x16 x) {
  const i32x16 bits = as_bits(x);
  i32x16 e = sub_i(shr_i(bits, 23), set1_i(127));
  f32x16 m = from_bits(or_i(and_i(bits, set1_i(0x007FFFFF)), set1_i(0x3F800000)));  // [1, 2)
  const lanes high = less(set1(1.41421356237f), m);
  m = select(high, mul(m, set1(0.5f)), m);
  e = select_i(high, add_i(e, set1_i(1)), e);
  const f32x16 f = sub(m, set1(1.0f));
  const f32x16 z = mul(f, f);
  const f32x16 p = horner(f, 7.0376836292e-2f, -1.1514610310e-1f, 1.1676998740e-1f, -1.2420140846e-1f, 1.4249322787e-1f,
                          -1.6668057665e-1f, 2.0000714765e-1f, -2.4999993993e-1f, 3.3333331174e-1f);
  const f32x16 fe = to_float(e);
  f32x16 y = mul(mul(p, f), z);
  y = fmadd(fe, set1(-2.12194440e-4f), y);
  y = fnmadd(set1(0.5f), z, y);
  return fmadd(fe, set1(0.693359375f), add(f, y));
}

// Byte products' sums kept as pairs (the caller bounds them within int16): p += u * s as dot_u7s8 adds them, each
// lane's two pair sums (its bytes 0-1 and 2-3) apart, then add_pairs(acc, p) adds lane i's two into acc's lane i.
// While every pair's running sum stays within int16 the sums are exactly dot_u7s8's, so the outputs' bits do not
// depend on whether a backend keeps them in 16 bits (AVX2, where it saves a widening per product: PAIR_SUMS) or,
// as here, in dot_u7s8's own int32 sums.
#ifndef TM_SIMD_PAIR_SUMS
constexpr bool PAIR_SUMS = false;
struct pairs16 { i32x16 s; };
inline pairs16 zero_pairs() { return {zero_i()}; }
inline pairs16 dot_u7s8_pairs(pairs16 p, u8x64 u, int32_t s4) { return {dot_u7s8(p.s, u, s4)}; }
inline i32x16 add_pairs(i32x16 acc, pairs16 p) { return add_i(acc, p.s); }
#endif

// The scalar forms of the functions above (lane 0 of the vector op): the same bits.
inline float exp_one(float x) { return lane0(exp(set1(x))); }
inline float tanh_one(float x) { return lane0(tanh(set1(x))); }
inline float exp2_nonpositive_one(float x) { return lane0(exp2_nonpositive(set1(x))); }
inline float log_one(float x) { return lane0(log(set1(x))); }

}  // namespace simd
