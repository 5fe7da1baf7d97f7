// The small per-token operations of a decoder layer, each one pass over its rows instead of the
// five to twelve torch operations (and their dispatch) it takes in kernels/torch_ops.py. float32 in
// and out; every row is computed on its own, in an order fixed by the row's length alone.
// Built and loaded by kernels/cpu/build.py (g++ -O3 -march=native -fopenmp).

#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "tm_abi.h"  // this file's prototypes (generated from abi.py)
#include "vec_math.h"

#if !defined(__AVX512F__)
#error "elementwise needs AVX-512F"
#endif

namespace {


inline __mmask16 tail_mask(int64_t remaining) {
  return remaining >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << remaining) - 1);
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
    __m512 squares = _mm512_setzero_ps();
    for (int64_t c = 0; c < d; c += 16) {
      const __mmask16 m = tail_mask(d - c);
      __m512 h = _mm512_maskz_loadu_ps(m, xi + c);
      if (residual) h = _mm512_add_ps(_mm512_maskz_loadu_ps(m, residual + i * d + c), h);
      _mm512_mask_storeu_ps(hi + c, m, h);
      squares = _mm512_fmadd_ps(h, h, squares);
    }
    const float inv = 1.0f / sqrtf(_mm512_reduce_add_ps(squares) / (float)d + eps);
    const __m512 scale = _mm512_set1_ps(inv);
    for (int64_t c = 0; c < d; c += 16) {
      const __mmask16 m = tail_mask(d - c);
      const __m512 h = _mm512_maskz_loadu_ps(m, hi + c);
      const __m512 y = _mm512_mul_ps(_mm512_mul_ps(h, scale), _mm512_maskz_loadu_ps(m, weight + c));
      _mm512_mask_storeu_ps(normed + i * d + c, m, y);
    }
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
      for (int64_t j = 0; j < half; j += 16) {
        const __mmask16 m = tail_mask(half - j);
        const __m512 a = _mm512_maskz_loadu_ps(m, x1 + j), b = _mm512_maskz_loadu_ps(m, x2 + j);
        const __m512 cv = _mm512_maskz_loadu_ps(m, c + j), sv = _mm512_maskz_loadu_ps(m, s + j);
        _mm512_mask_storeu_ps(x1 + j, m, _mm512_sub_ps(_mm512_mul_ps(a, cv), _mm512_mul_ps(b, sv)));
        _mm512_mask_storeu_ps(x2 + j, m, _mm512_add_ps(_mm512_mul_ps(b, cv), _mm512_mul_ps(a, sv)));
      }
    }
  }
}

// out[i] = silu(gate[i]) * up[i] for x = [gate | up] rows of 2 * n; out: [t, n].
void tm_silu_and_mul(const float* x, float* out, int64_t t, int64_t n) {
  for (int64_t i = 0; i < t; ++i) {
    const float* gate = x + i * 2 * n;
    const float* up = gate + n;
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 m = tail_mask(n - j);
      const __m512 g = _mm512_maskz_loadu_ps(m, gate + j);
      const __m512 sig = _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
      _mm512_mask_storeu_ps(out + i * n + j, m, _mm512_mul_ps(_mm512_mul_ps(g, sig), _mm512_maskz_loadu_ps(m, up + j)));
    }
  }
}

// Gemma's GeGLU for x = [gate | up] rows of 2 * n; out: [t, n]: gelu(gate, tanh approximation) * up,
// gelu's 0.5 * g * (1 + tanh(u)), u = sqrt(2 / pi) * (g + 0.044715 * g^3), computed as g * sigmoid(2u)
// (the same number: 0.5 * (1 + tanh(u)) = 1 / (1 + e^(-2u))), which keeps its relative precision where
// 1 + tanh(u) would cancel (g well below 0); the sigmoid as SiLU's above. The eager MLP (the native
// ops' gelu_tanh_and_mul) and the decoder stack both call this, so their bits agree.
void tm_gelu_tanh_and_mul(const float* x, float* out, int64_t t, int64_t n) {
  // -2u = g * (a + b * g^2): a = -2 sqrt(2 / pi), b = a * 0.044715.
  const __m512 a = _mm512_set1_ps(-1.5957691216057308f), b = _mm512_set1_ps(-0.07135481627260025f);
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t i = 0; i < t; ++i) {
    const float* gate = x + i * 2 * n;
    const float* up = gate + n;
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 m = tail_mask(n - j);
      const __m512 g = _mm512_maskz_loadu_ps(m, gate + j);
      const __m512 z = _mm512_mul_ps(g, _mm512_fmadd_ps(_mm512_mul_ps(g, g), b, a));
      const __m512 sig = _mm512_div_ps(one, _mm512_add_ps(one, exp16(z)));
      _mm512_mask_storeu_ps(out + i * n + j, m, _mm512_mul_ps(_mm512_mul_ps(g, sig), _mm512_maskz_loadu_ps(m, up + j)));
    }
  }
}

// gpt-oss's experts' activation for x = [gate | up] rows of 2 * n; out: [t, n]:
// g = min(gate, limit), u = clamp(up, -limit, limit), out = (g * sigmoid(g * alpha)) * (u + 1), the
// sigmoid as SiLU's above; NaN passes the clamps, as torch.clamp lets it. The eager experts and the
// native experts call (moe_mlp.cpp) both call this, so their bits agree.
void tm_clamped_swiglu_and_mul(const float* x, float* out, int64_t t, int64_t n, float alpha, float limit) {
  const __m512 hi = _mm512_set1_ps(limit), lo = _mm512_set1_ps(-limit), a = _mm512_set1_ps(alpha);
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t i = 0; i < t; ++i) {
    const float* gate = x + i * 2 * n;
    const float* up = gate + n;
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 m = tail_mask(n - j);
      // min/max return their second operand when either is NaN: the value, so NaN stays NaN.
      const __m512 g = _mm512_min_ps(hi, _mm512_maskz_loadu_ps(m, gate + j));
      const __m512 u = _mm512_max_ps(lo, _mm512_min_ps(hi, _mm512_maskz_loadu_ps(m, up + j)));
      const __m512 z = _mm512_mul_ps(g, a);
      const __m512 sig = _mm512_div_ps(one, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), z))));
      _mm512_mask_storeu_ps(out + i * n + j, m, _mm512_mul_ps(_mm512_mul_ps(g, sig), _mm512_add_ps(u, one)));
    }
  }
}
}
