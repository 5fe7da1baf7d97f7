// The softmax and log-softmax the sampler and the reported logprobs take, over rows of logits, with the
// same bits on every CPU: torch's own (ATen's) sum a row in its vector width's order (8 lanes with AVX2,
// 16 with AVX-512) and take exp and log from a library chosen by the CPU, so its logprobs would differ
// between two replicas' CPUs. Here every row is: its maximum m; the sum of e^(x - m), in 16 lanes
// (lane j takes the entries j, j + 16, ... in order) then simd.h's tree; and for the log-softmax
// (x - m) - ln(sum). e^(x - m) is simd::exp, with x - m below -87 (e^-87 is float32's smallest normal)
// taken as exactly 0, so a token masked to -inf has probability 0 and log-probability -inf.
// And the greedy choice: the first index of each row's maximum, as torch's max(dim=-1).indices gives it.

#include <math.h>
#include <omp.h>
#include <stdint.h>

#include "simd.h"
#include "tm_abi.h"  // this file's prototypes (generated from abi.py)

namespace {

using namespace simd;

constexpr float FLUSH = -87.0f;

inline f32x16 exp_or_zero(f32x16 d) { return select(less(d, set1(FLUSH)), zero_f(), exp(d)); }

// The row's maximum; lanes past its end keep -inf.
inline float row_max(const float* x, int64_t n) {
  f32x16 m = set1(-INFINITY);
  for (int64_t j = 0; j < n; j += 16) {
    const lanes live = first_lanes(n - j);
    m = select(live, max(m, load_masked(x + j, live)), m);
  }
  return reduce_max(m);
}

// The sum of e^(x - m) over the row, writing each e^(x - m) to e (when given).
inline float exp_sum(const float* x, int64_t n, float m, float* e) {
  f32x16 s = zero_f();
  const f32x16 mv = set1(m);
  for (int64_t j = 0; j < n; j += 16) {
    const lanes live = first_lanes(n - j);
    const f32x16 v = select(live, exp_or_zero(sub(load_masked(x + j, live), mv)), zero_f());
    if (e) store_masked(e + j, live, v);
    s = add(s, v);
  }
  return reduce_add(s);
}

}  // namespace

extern "C" {

// out[r] = log_softmax(x[r]) for rows r < rows of n floats (row strides x_stride and n).
void tm_log_softmax(const float* x, int64_t rows, int64_t n, int64_t x_stride, float* out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * x_stride;
    float* o = out + r * n;
    const float m = row_max(xr, n);
    const float ls = log_one(exp_sum(xr, n, m, nullptr));
    const f32x16 mv = set1(m), lv = set1(ls);
    for (int64_t j = 0; j < n; j += 16) {
      const lanes live = first_lanes(n - j);
      store_masked(o + j, live, sub(sub(load_masked(xr + j, live), mv), lv));
    }
  }
}

// out[r] = the first index of row r's maximum (rows x_stride floats apart), or -1 where the row holds a NaN
// (torch's max takes a NaN for the maximum: the caller leaves such rows to it). Two passes: the maximum m (and
// whether any entry is neither below +inf nor +inf: a NaN), then the first entry not below m. A pass over
// 128,256 logits in the cache; torch's max(dim=-1) took 0.19 ms a decoding step of Llama-3.2-1B's vocabulary
// on an AMD EPYC.
void tm_argmax_rows(const float* x, int64_t rows, int64_t n, int64_t x_stride, int64_t* out) {
  const f32x16 inf = set1(INFINITY);
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * x_stride;
    f32x16 mv = set1(-INFINITY);
    unsigned nan = 0;
    for (int64_t j = 0; j < n; j += 16) {
      const lanes live = first_lanes(n - j);
      const f32x16 v = load_masked(xr + j, live);
      mv = select(live, max(mv, v), mv);
      nan |= (unsigned)(live & (lanes)~less(v, inf) & (lanes)~equal_i(as_bits(v), as_bits(inf)));
    }
    out[r] = -1;
    if (nan) continue;
    mv = set1(reduce_max(mv));
    for (int64_t j = 0; j < n; j += 16) {
      const unsigned hit = (unsigned)(first_lanes(n - j) & (lanes)~less(load_masked(xr + j, first_lanes(n - j)), mv));
      if (hit) {
        out[r] = j + __builtin_ctz(hit);
        break;
      }
    }
  }
}

// out = softmax(x) for one row of n floats: e^(x - m) / sum.
void tm_softmax(const float* x, int64_t n, float* out) {
  const float m = row_max(x, n);
  const float s = exp_sum(x, n, m, out);
  const f32x16 sv = set1(s);
  for (int64_t j = 0; j < n; j += 16) {
    const lanes live = first_lanes(n - j);
    store_masked(out + j, live, div(load_masked(out + j, live), sv));
  }
}
}
