// Every op of simd.h on given inputs, built once per instruction set like a kernel (build.compile_source):
// check_simd.cpp feeds two builds the same inputs, edge values included, and compares every output.
#include <stdint.h>
#include <string.h>

#include "simd.h"

using namespace simd;

extern "C" {

// One 16-lane round: fa, fb, fc 16 floats; ia, ib 16 int32; ba, bb 64 bytes; ha 16 float16 bits; s a dword;
// n 0..16 (a count for the masks). Writes FOUT floats, IOUT int32, BOUT bytes (the counts below).
int tm_simd_probe(const float* fa, const float* fb, const float* fc, const int32_t* ia, const int32_t* ib,
                  const uint8_t* ba, const uint8_t* bb, const uint16_t* ha, int32_t s, int n, float* fo, int32_t* io,
                  uint8_t* bo) {
  const f32x16 a = load(fa), b = load(fb), c = load(fc);
  const lanes m = first_lanes(n) ^ (lanes)(s & 0x5A5A);
  int f = 0, i = 0, k = 0;
  auto F = [&](f32x16 x) { store(fo + 16 * f++, x); };
  auto Iv = [&](i32x16 x) {  // each lane, as a one-lane select's sum (the interface has no int32 store)
    for (int j = 0; j < 16; ++j) io[16 * i + j] = reduce_add_i(select_i((lanes)(1u << j), x, zero_i()));
    ++i;
  };
  auto Iw = [&](i32x16 x) {
    int16_t w[16];
    int8_t b8[16];
    store_i16(w, x);
    store_i8(b8, x);
    for (int j = 0; j < 16; ++j) io[16 * i + j] = (int32_t)(uint16_t)w[j] | (int32_t)((uint32_t)(uint8_t)b8[j] << 16);
    ++i;
  };
  auto B = [&](u8x64 x) { store_b(bo + 64 * k++, x); };

  F(add(a, b)); F(sub(a, b)); F(mul(a, b)); F(div(a, b)); F(max(a, b)); F(min(a, b));
  F(fmadd(a, b, c)); F(fnmadd(a, b, c)); F(abs(a)); F(copy_sign(a, b)); F(round_even(a));
  F(scale2(b, round_even(min(max(mul(a, set1(127.0f)), set1(-126.0f)), set1(127.0f)))));
  F(select(m, a, b)); F(load_masked(fa, m)); F(load_half(ha)); F(load_bf16(ha)); F(load_bf16_masked(ha, m));
  F(exp(a)); F(exp(mul(a, set1(100.0f)))); F(exp2_nonpositive(sub(zero_f(), abs(mul(a, set1(50.0f))))));
  F(tanh(a)); F(tanh(mul(a, set1(4.0f)))); F(log(add(abs(a), set1(1.0f)))); F(log(add(abs(mul(a, set1(1e4f))), set1(1e-30f))));
  F(from_bits(as_bits(a)));
  F(to_float(load_i(ia)));
  {
    f32x16 t = set1(0.0f);
    store_masked(fo + 16 * f, 0xFFFF, t);
    store_masked(fo + 16 * f, m, a);
    ++f;
  }
  float r4[4];
  reduce_add4(a, b, c, mul(a, b), r4);
  float sc[16] = {reduce_add(a), reduce_max(a), reduce_add(b), reduce_max(c), lane0(a), r4[0], r4[1], r4[2], r4[3],
                  half_to_float(ha[0]), half_to_float(ha[1]), (float)float_to_half(fa[0]), (float)float_to_half(fb[0]),
                  (float)float_to_half(fc[0]), (float)less(a, b), (float)equal_i(load_i(ia), load_i(ib))};
  memcpy(fo + 16 * f++, sc, 64);

  const i32x16 x = load_i(ia), y = load_i(ib);
  Iv(add_i(x, y)); Iv(sub_i(x, y)); Iv(shl_i(x, s & 7)); Iv(shr_i(x, (s >> 3) & 31)); Iv(and_i(x, y)); Iv(or_i(x, y)); Iv(max_i(x, y)); Iv(select_i(m, x, y));
  Iv(load_u8_i(ba)); Iv(load_s8_i((const int8_t*)bb)); Iv(permute_i(x, y)); Iv(saturate_i8(x));
  Iv(to_int(a)); Iv(to_int(mul(a, set1(3e9f)))); Iv(set1_i(reduce_add_i(x)));
  Iw(x);
  const u8x64 u = load_b(ba), v = load_b(bb);
  const u8x64 nib = and_b(u, set1_b(0x0F)), small = and_b(u, set1_b(0x7F));
  Iv(dot_u8s8(x, u, s)); Iv(dot_u7s8(x, small, s)); Iv(dot_s16(x, v, s)); Iv(dot_u8s8(zero_i(), v, ~s));
  B(and_b(u, v)); B(or_b(u, v)); B(or_and(u, v, set1_w(0x1234))); B(shr16(u, s & 15)); B(shl16(v, (s >> 4) & 15));
  B(lookup16(bb, nib)); B(set1_b((uint8_t)s));
  return f * 1000000 + i * 1000 + k;
}
}
