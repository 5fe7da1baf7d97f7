// The small per-token operations of a decoder layer, each one pass over its rows instead of the
// five to twelve torch operations (and their dispatch) it takes in kernels/torch_ops.py. float32 in
// and out; every row is computed on its own, in an order fixed by the row's length alone.
// Written in simd.h's ops (the same bits on every instruction set); built and loaded by
// kernels/cpu/build.py.

#include <math.h>
#include <stdint.h>

#include "simd.h"
#include "tm_abi.h"  // this file's prototypes (generated from abi.py)

using namespace simd;

namespace {

// Calls f(j, m) for each 16-lane step of [0, n): m all lanes but in the tail, whose missing lanes read
// as 0 and are never written. Whole steps take plain loads (a masked load costs more off AVX-512).
template <class F>
inline void steps(int64_t n, F f) {
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) f(j, (lanes)0xFFFF);
  if (j < n) f(j, first_lanes(n - j));
}

inline f32x16 load_lanes(const float* p, lanes m) { return m == 0xFFFF ? load(p) : load_masked(p, m); }
inline void store_lanes(float* p, lanes m, f32x16 a) {
  if (m == 0xFFFF) store(p, a);
  else store_masked(p, m, a);
}

// 1 / (1 + e^-z): the sigmoid of SiLU, GeGLU and the clamped SwiGLU (exp clamps its argument, so a
// huge |z| gives 0 or 1, never inf / inf).
inline f32x16 sigmoid(f32x16 z) {
  const f32x16 one = set1(1.0f);
  return div(one, add(one, exp(sub(zero_f(), z))));
}

}  // namespace

extern "C" {

// h = x + residual (or x alone when residual is null), written to h_out; normed = h / rms(h) * weight.
// x, residual, h_out, normed: [t, d] with row strides; weight: [d].
void tm_rms_norm(const float* x, int64_t x_stride, const float* residual, const float* weight, float eps,
                 float* h_out, float* normed, int64_t t, int64_t d) {
  for (int64_t i = 0; i < t; ++i) {
    const float* xi = x + i * x_stride;
    float* hi = h_out + i * d;
    // One 16-lane chain of squares in column order; the tail's missing lanes add 0 * 0.
    f32x16 squares = zero_f();
    steps(d, [&](int64_t c, lanes m) {
      f32x16 h = load_lanes(xi + c, m);
      if (residual) h = add(load_lanes(residual + i * d + c, m), h);
      store_lanes(hi + c, m, h);
      squares = fmadd(h, h, squares);
    });
    const float inv = 1.0f / sqrtf(reduce_add(squares) / (float)d + eps);
    const f32x16 scale = set1(inv);
    steps(d, [&](int64_t c, lanes m) {
      const f32x16 y = mul(mul(load_lanes(hi + c, m), scale), load_lanes(weight + c, m));
      store_lanes(normed + i * d + c, m, y);
    });
  }
}

// Rotates, in place, the first rotary_dim dims of each of the `heads` heads (head_dim apart) of every
// row of x (row stride x_stride), their two halves by the angle of the row's position; the head's other
// dims are left as they are (partial rotary: Phi-4-mini's; rotary_dim == head_dim rotates whole heads).
// cos/sin are [positions, rotary_dim / 2].
void tm_rotary(float* x, int64_t x_stride, int64_t t, int64_t heads, int64_t head_dim, int64_t rotary_dim,
               const int64_t* positions, const float* cos_table, const float* sin_table) {
  const int64_t half = rotary_dim / 2;
  for (int64_t i = 0; i < t; ++i) {
    const float* c = cos_table + positions[i] * half;
    const float* s = sin_table + positions[i] * half;
    for (int64_t h = 0; h < heads; ++h) {
      float* x1 = x + i * x_stride + h * head_dim;
      float* x2 = x1 + half;
      steps(half, [&](int64_t j, lanes m) {
        const f32x16 a = load_lanes(x1 + j, m), b = load_lanes(x2 + j, m);
        const f32x16 cv = load_lanes(c + j, m), sv = load_lanes(s + j, m);
        store_lanes(x1 + j, m, sub(mul(a, cv), mul(b, sv)));
        store_lanes(x2 + j, m, add(mul(b, cv), mul(a, sv)));
      });
    }
  }
}

// out[i] = silu(gate[i]) * up[i] for x = [gate | up] rows of 2 * n; out: [t, n].
void tm_silu_and_mul(const float* x, float* out, int64_t t, int64_t n) {
  for (int64_t i = 0; i < t; ++i) {
    const float* gate = x + i * 2 * n;
    const float* up = gate + n;
    steps(n, [&](int64_t j, lanes m) {
      const f32x16 g = load_lanes(gate + j, m);
      store_lanes(out + i * n + j, m, mul(mul(g, sigmoid(g)), load_lanes(up + j, m)));
    });
  }
}

// Gemma's GeGLU for x = [gate | up] rows of 2 * n; out: [t, n]: gelu(gate, tanh approximation) * up,
// gelu's 0.5 * g * (1 + tanh(u)), u = sqrt(2 / pi) * (g + 0.044715 * g^3), computed as g * sigmoid(2u)
// (the same number: 0.5 * (1 + tanh(u)) = 1 / (1 + e^(-2u))), which keeps its relative precision where
// 1 + tanh(u) would cancel (g well below 0); the sigmoid as SiLU's above. The eager MLP (the native
// ops' gelu_tanh_and_mul) and the decoder stack both call this, so their bits agree.
void tm_gelu_tanh_and_mul(const float* x, float* out, int64_t t, int64_t n) {
  // -2u = g * (a + b * g^2): a = -2 sqrt(2 / pi), b = a * 0.044715.
  const f32x16 a = set1(-1.5957691216057308f), b = set1(-0.07135481627260025f);
  const f32x16 one = set1(1.0f);
  for (int64_t i = 0; i < t; ++i) {
    const float* gate = x + i * 2 * n;
    const float* up = gate + n;
    steps(n, [&](int64_t j, lanes m) {
      const f32x16 g = load_lanes(gate + j, m);
      const f32x16 z = mul(g, fmadd(mul(g, g), b, a));
      const f32x16 sig = div(one, add(one, exp(z)));
      store_lanes(out + i * n + j, m, mul(mul(g, sig), load_lanes(up + j, m)));
    });
  }
}

// gpt-oss's experts' activation for x = [gate | up] rows of 2 * n; out: [t, n]:
// g = min(gate, limit), u = clamp(up, -limit, limit), out = (g * sigmoid(g * alpha)) * (u + 1), the
// sigmoid as SiLU's above; NaN passes the clamps, as torch.clamp lets it. The eager experts and the
// native experts call (moe_mlp.cpp) both call this, so their bits agree.
void tm_clamped_swiglu_and_mul(const float* x, float* out, int64_t t, int64_t n, float alpha, float limit) {
  const f32x16 hi = set1(limit), lo = set1(-limit), a = set1(alpha);
  const f32x16 one = set1(1.0f);
  for (int64_t i = 0; i < t; ++i) {
    const float* gate = x + i * 2 * n;
    const float* up = gate + n;
    steps(n, [&](int64_t j, lanes m) {
      // min/max return their second operand when either is NaN: the value, so NaN stays NaN.
      const f32x16 g = min(hi, load_lanes(gate + j, m));
      const f32x16 u = max(lo, min(hi, load_lanes(up + j, m)));
      store_lanes(out + i * n + j, m, mul(mul(g, sigmoid(mul(g, a))), add(u, one)));
    });
  }
}
}
