// simd.h op by op: two builds of simd_probe.cpp, random lanes and every edge value (zeros of both signs,
// infinities, NaN, subnormals, float16's limits, int32's, ties for the roundings).
#include "check.h"

typedef int (*Probe)(const float*, const float*, const float*, const int32_t*, const int32_t*, const uint8_t*,
                     const uint8_t*, const uint16_t*, int32_t, int, float*, int32_t*, uint8_t*);

static float edge(check::Rng& rng) {
  static const float values[] = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, 1e-40f, -1e-40f, 1.17549435e-38f, 0.5f, 1.5f,
                                 2.5f, -0.5f, -2.5f, 65504.0f, 65520.0f, 65519.0f, 6.1e-5f, 5.96e-8f, 2.98e-8f,
                                 2.9802322e-8f, 3e-8f, 2147483648.0f, -2147483648.0f, 2147483520.0f, 87.5f, -87.5f,
                                 88.7f, -100.0f, 0.625f, -0.625f, 1e-30f, 3.4e38f, 8388608.5f, 0.49999997f};
  const size_t n = sizeof(values) / sizeof(values[0]);
  return rng.below(3) == 0 ? values[rng.below((int64_t)n)] : rng.normal((float)(1 << rng.below(8)) / 8.0f);
}

CHECK_MAIN("simd")
void run(const check::Lib& ref, const check::Lib& cand, check::Report& report) {
  const Probe p = ref.fn<Probe>("tm_simd_probe"), q = cand.fn<Probe>("tm_simd_probe");
  check::Rng rng(7);
  for (int round = 0; round < 4000; ++round) {
    float a[16], b[16], c[16];
    int32_t ia[16], ib[16];
    uint8_t ba[64], bb[64];
    uint16_t ha[16];
    for (int j = 0; j < 16; ++j) {
      a[j] = edge(rng);
      b[j] = edge(rng);
      c[j] = edge(rng);
      ia[j] = rng.below(4) == 0 ? (int32_t)rng.next() : (int32_t)rng.below(64) - 32;
      ib[j] = rng.below(4) == 0 ? (int32_t)rng.next() : (int32_t)rng.below(64) - 32;
      ha[j] = (uint16_t)rng.next();
    }
    for (int j = 0; j < 64; ++j) {
      ba[j] = (uint8_t)rng.next();
      bb[j] = (uint8_t)rng.next();
    }
    const int32_t s = (int32_t)rng.next();
    const int n = (int)rng.below(17);
    std::vector<float> fo1(16 * 64), fo2(16 * 64);
    std::vector<int32_t> io1(16 * 64), io2(16 * 64);
    std::vector<uint8_t> bo1(64 * 16), bo2(64 * 16);
    const int r1 = p(a, b, c, ia, ib, ba, bb, ha, s, n, fo1.data(), io1.data(), bo1.data());
    const int r2 = q(a, b, c, ia, ib, ba, bb, ha, s, n, fo2.data(), io2.data(), bo2.data());
    if (r1 != r2) {
      fprintf(stderr, "the probes wrote different counts: %d against %d\n", r1, r2);
      ++report.failures;
      return;
    }
    // Each float output a check of its own, so a difference names the op (its index in the probe).
    const int nf = r1 / 1000000, ni = r1 / 1000 % 1000, nb = r1 % 1000;
    char what[64];
    bool ok = true;
    for (int k = 0; k < nf && ok; ++k) {
      snprintf(what, sizeof what, "float op %d (round %d)", k, round);
      ok = report.same_floats(what, fo1.data() + 16 * k, fo2.data() + 16 * k, 16);
    }
    for (int k = 0; k < ni && ok; ++k) {
      snprintf(what, sizeof what, "int op %d (round %d)", k, round);
      ok = report.same(what, io1.data() + 16 * k, io2.data() + 16 * k, 64);
    }
    for (int k = 0; k < nb && ok; ++k) {
      snprintf(what, sizeof what, "byte op %d (round %d)", k, round);
      ok = report.same(what, bo1.data() + 64 * k, bo2.data() + 64 * k, 64, 1);
    }
    if (!ok) return;
  }
}
