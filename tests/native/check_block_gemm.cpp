// block_gemm.cpp, two builds bit for bit: tm_block_dequantize on blocks of random bytes (every scale's bits:
// float16 subnormals, infinities, NaN) and tm_block_gemm on blocks with ordinary scales, for every format, at
// row counts 1..6, 8, 17 and 40 (the few-row path, the register tiles' edges, several passes of rows), weight
// row counts with tails of the tiles, 1 and 2 threads.
#include "check.h"

typedef int (*Gemm)(int fmt, const float* x, int64_t m, int64_t k, const uint8_t* w, int64_t n, float* y,
                    int threads);
typedef int (*Dequantize)(int fmt, const uint8_t* w, int64_t n, int64_t k, float* out);

namespace {

struct Format {
  const char* name;
  int id, bytes;
  int scales[2];  // where the block's float16 scales are (-1: none)
};
// ggml's ids and block sizes (abi.py's BLOCK_FORMATS); F32 is plain float32 rows.
const Format FORMATS[] = {
    {"F32", 0, 128, {-1, -1}},   {"Q4_0", 2, 18, {0, -1}},   {"Q4_1", 3, 20, {0, 2}}, {"Q5_0", 6, 22, {0, -1}},
    {"Q5_1", 7, 24, {0, 2}},     {"Q8_0", 8, 34, {0, -1}},   {"IQ4_NL", 20, 18, {0, -1}},
    {"MXFP4", 39, 17, {-1, -1}},
};

// n rows of k weights: random bytes, then (ordinary) each scale a small float16 and each MXFP4 exponent within
// 2^-20 .. 2^15, F32 weights normal floats; otherwise every bit random.
std::vector<uint8_t> blocks(const Format& f, int64_t n, int64_t k, bool ordinary, check::Rng& rng) {
  const int64_t count = n * (k / 32);
  std::vector<uint8_t> w(count * f.bytes);
  rng.fill_bytes(w);
  if (!ordinary) return w;
  for (int64_t b = 0; b < count; ++b) {
    uint8_t* p = w.data() + b * f.bytes;
    if (f.id == 0) {
      for (int j = 0; j < 32; ++j) {
        const float v = rng.normal();
        memcpy(p + 4 * j, &v, 4);
      }
    } else if (f.id == 39) {
      p[0] = (uint8_t)(108 + rng.below(36));
      if (rng.below(50) == 0) p[0] = (uint8_t)rng.below(2);  // a subnormal scale now and then
    }
    for (int s : f.scales) {
      if (s < 0) continue;
      const uint16_t h = check::half_of(rng.uniform(-0.02f, 0.02f));
      memcpy(p + s, &h, 2);
    }
  }
  return w;
}

}  // namespace

CHECK_MAIN("block_gemm")
void run(const check::Lib& ref, const check::Lib& cand, check::Report& report) {
  const Gemm g1 = ref.fn<Gemm>("tm_block_gemm"), g2 = cand.fn<Gemm>("tm_block_gemm");
  const Dequantize d1 = ref.fn<Dequantize>("tm_block_dequantize"), d2 = cand.fn<Dequantize>("tm_block_dequantize");
  check::Rng rng(11);
  char what[160];
  for (const Format& f : FORMATS) {
    // Every bit of the blocks: the formats' decoding alone.
    {
      const int64_t n = 7, k = 96;
      const std::vector<uint8_t> w = blocks(f, n, k, false, rng);
      std::vector<float> o1(n * k, 1.0f), o2(n * k, 2.0f);
      const int r1 = d1(f.id, w.data(), n, k, o1.data()), r2 = d2(f.id, w.data(), n, k, o2.data());
      snprintf(what, sizeof what, "%s dequantize (random bits)", f.name);
      if (r1 != r2 || r1 != 0) {
        fprintf(stderr, "%s: returned %d and %d\n", what, r1, r2);
        ++report.failures;
      }
      report.same(what, o1, o2);
    }
    // (k, n): one block, tails of the weight tiles (n not a multiple of 4 or 2), larger k; 40 rows at k = 4096 take
    // several passes of rows (as many as fit in L2 beside the weights).
    const int64_t shapes[][2] = {{32, 1}, {64, 7}, {96, 18}, {320, 33}, {4096, 6}};
    for (const auto& shape : shapes) {
      const int64_t k = shape[0], n = shape[1];
      const std::vector<uint8_t> w = blocks(f, n, k, true, rng);
      {
        std::vector<float> o1(n * k), o2(n * k);
        d1(f.id, w.data(), n, k, o1.data());
        d2(f.id, w.data(), n, k, o2.data());
        snprintf(what, sizeof what, "%s dequantize k=%lld n=%lld", f.name, (long long)k, (long long)n);
        report.same(what, o1, o2);
      }
      for (int64_t m : {1, 2, 3, 4, 5, 6, 8, 17, 40}) {
        if (k == 4096 && m != 1 && m != 5 && m != 40) continue;  // few rows, one tile, several passes
        std::vector<float> x(m * k);
        rng.fill(x);
        for (int64_t j = 0; j < 32; ++j) x[j] *= 1e-30f;  // a block of tiny values
        if (m > 1) x[k + 3] = 0.0f;
        for (int threads : {1, 2}) {
          std::vector<float> y1(m * n, 7.0f), y2(m * n, 9.0f);
          const int r1 = g1(f.id, x.data(), m, k, w.data(), n, y1.data(), threads);
          const int r2 = g2(f.id, x.data(), m, k, w.data(), n, y2.data(), threads);
          snprintf(what, sizeof what, "%s gemm k=%lld n=%lld m=%lld threads=%d", f.name, (long long)k, (long long)n,
                   (long long)m, threads);
          if (r1 != 0 || r2 != 0) {
            fprintf(stderr, "%s: returned %d and %d\n", what, r1, r2);
            ++report.failures;
          }
          report.same(what, y1, y2);
        }
      }
    }
  }
  // The refusals: an unknown format, k not a multiple of 32.
  float y[4] = {0, 0, 0, 0}, x[48] = {0};
  uint8_t w[256] = {0};
  const int codes[4] = {g1(1, x, 1, 32, w, 1, y, 1), g2(1, x, 1, 32, w, 1, y, 1), g1(2, x, 1, 48, w, 1, y, 1),
                        g2(2, x, 1, 48, w, 1, y, 1)};
  ++report.checks;
  if (codes[0] != -1 || codes[1] != -1 || codes[2] != -2 || codes[3] != -2) {
    fprintf(stderr, "refusals: %d %d %d %d (want -1 -1 -2 -2)\n", codes[0], codes[1], codes[2], codes[3]);
    ++report.failures;
  }
}
