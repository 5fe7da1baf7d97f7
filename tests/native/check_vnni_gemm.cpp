// vnni_gemm.cpp, every export, two builds side by side: the same GGUF blocks of each format packed, multiplied
// by the same activations (rows 1..5, 8, 17: the tiles change with M; n not a multiple of 16; k long enough for
// the decoding tiles' prefetch), dequantized and quantized, on 1 and 2 threads; with 16-bit and with 8-bit
// activations (tm_vnni_gemm_int8).
#include "check.h"

typedef int64_t (*PackedBytes)(int, int64_t, int64_t);
typedef int (*Pack)(int, const uint8_t*, int64_t, int64_t, uint8_t*);
typedef int (*Gemm)(int, const float*, int64_t, int64_t, const uint8_t*, int64_t, float*, int);
typedef int (*Dequantize)(int, const uint8_t*, int64_t, int64_t, float*);
typedef int (*Quantize)(const float*, int64_t, int64_t, int16_t*, float*);
typedef int (*QuantizeInt8)(const float*, int64_t, int64_t, int8_t*, float*);

struct Format {
  const char* name;
  int id;           // ggml's type (abi.py)
  int bytes;        // per block of 32
  int scales[2];    // byte offsets of its float16 fields (-1: none)
};

static const Format FORMATS[] = {
    {"Q4_0", 2, 18, {0, -1}}, {"Q4_1", 3, 20, {0, 2}},  {"Q5_0", 6, 22, {0, -1}},   {"Q5_1", 7, 24, {0, 2}},
    {"Q8_0", 8, 34, {0, -1}}, {"IQ4_NL", 20, 18, {0, -1}}, {"MXFP4", 39, 17, {-1, -1}},
};

struct Fns {
  PackedBytes packed_bytes;
  Pack pack;
  Gemm gemm;
  Dequantize dequantize;
  Quantize quantize;
  Gemm gemm_int8;
  QuantizeInt8 quantize_int8;
  explicit Fns(const check::Lib& lib)
      : packed_bytes(lib.fn<PackedBytes>("tm_vnni_packed_bytes")),
        pack(lib.fn<Pack>("tm_vnni_pack")),
        gemm(lib.fn<Gemm>("tm_vnni_gemm")),
        dequantize(lib.fn<Dequantize>("tm_vnni_dequantize")),
        quantize(lib.fn<Quantize>("tm_vnni_quantize")),
        gemm_int8(lib.fn<Gemm>("tm_vnni_gemm_int8")),
        quantize_int8(lib.fn<QuantizeInt8>("tm_vnni_quantize_int8")) {}
};

// n rows of k / 32 random blocks: random weight bytes, scales of either sign (a few zero), MXFP4's exponents
// inside what the kernel holds.
static std::vector<uint8_t> blocks(const Format& f, int64_t n, int64_t k, check::Rng& rng) {
  std::vector<uint8_t> b((size_t)(n * (k / 32) * f.bytes));
  rng.fill_bytes(b);
  for (size_t at = 0; at < b.size(); at += (size_t)f.bytes) {
    for (int s : f.scales) {
      if (s < 0) continue;
      const uint16_t h = rng.below(50) == 0 ? 0 : check::half_of(rng.uniform(-0.02f, 0.02f));
      memcpy(&b[at + (size_t)s], &h, 2);
    }
    if (f.id == 39) b[at] = (uint8_t)(104 + rng.below(40));  // 2^(E - 128) in 2^-24 .. 2^15
  }
  return b;
}

// Activations: normal rows, with a block of tiny values, one of zeros and, in the last row of a large enough
// batch, a block whose 1 / d overflows and one holding inf and NaN.
static std::vector<float> activations(int64_t m, int64_t k, check::Rng& rng) {
  std::vector<float> x((size_t)(m * k));
  rng.fill(x);
  for (int64_t j = 0; j < 32; ++j) x[(size_t)j] *= 1e-30f;
  if (k >= 64)
    for (int64_t j = 32; j < 64; ++j) x[(size_t)((m - 1) * k + j)] = 0.0f;
  if (m >= 3 && k >= 128) {
    float* last = x.data() + (m - 1) * k;
    for (int64_t j = 64; j < 96; ++j) last[j] *= 1e-38f;
    last[100] = INFINITY;
    last[101] = NAN;
  }
  return x;
}

CHECK_MAIN("vnni_gemm")
void run(const check::Lib& ref_lib, const check::Lib& cand_lib, check::Report& report) {
  const Fns ref(ref_lib), cand(cand_lib);
  check::Rng rng(11);
  char what[128];
  struct Shape { int64_t n, k; };
  // k = 1024: a group's stride passes the prefetch distance (8 KB) in every format.
  const Shape shapes[] = {{16, 32}, {37, 96}, {50, 256}, {40, 1024}};
  const int64_t ms[] = {1, 2, 3, 4, 5, 8, 17};
  for (const Format& f : FORMATS) {
    for (const Shape& sh : shapes) {
      const std::vector<uint8_t> src = blocks(f, sh.n, sh.k, rng);
      const int64_t bytes = ref.packed_bytes(f.id, sh.n, sh.k);
      snprintf(what, sizeof what, "%s packed bytes n=%lld k=%lld", f.name, (long long)sh.n, (long long)sh.k);
      const int64_t bytes2 = cand.packed_bytes(f.id, sh.n, sh.k);
      report.same(what, &bytes, &bytes2, sizeof bytes, 1);
      std::vector<uint8_t> w1((size_t)bytes), w2((size_t)bytes);
      int rc1 = ref.pack(f.id, src.data(), sh.n, sh.k, w1.data());
      int rc2 = cand.pack(f.id, src.data(), sh.n, sh.k, w2.data());
      snprintf(what, sizeof what, "%s pack n=%lld k=%lld", f.name, (long long)sh.n, (long long)sh.k);
      report.same(what, &rc1, &rc2, sizeof rc1);
      report.same(what, w1, w2);
      std::vector<float> d1((size_t)(sh.n * sh.k)), d2(d1.size());
      rc1 = ref.dequantize(f.id, w1.data(), sh.n, sh.k, d1.data());
      rc2 = cand.dequantize(f.id, w1.data(), sh.n, sh.k, d2.data());
      snprintf(what, sizeof what, "%s dequantize n=%lld k=%lld", f.name, (long long)sh.n, (long long)sh.k);
      report.same(what, &rc1, &rc2, sizeof rc1);
      report.same(what, d1, d2);
      for (int64_t m : ms) {
        const std::vector<float> x = activations(m, sh.k, rng);
        for (int threads = 1; threads <= 2; ++threads) {
          std::vector<float> y1((size_t)(m * sh.n), -1.0f), y2(y1.size(), -1.0f);
          rc1 = ref.gemm(f.id, x.data(), m, sh.k, w1.data(), sh.n, y1.data(), threads);
          rc2 = cand.gemm(f.id, x.data(), m, sh.k, w1.data(), sh.n, y2.data(), threads);
          snprintf(what, sizeof what, "%s gemm m=%lld n=%lld k=%lld threads=%d", f.name, (long long)m, (long long)sh.n,
                   (long long)sh.k, threads);
          report.same(what, &rc1, &rc2, sizeof rc1);
          report.same(what, y1, y2);
          std::fill(y1.begin(), y1.end(), -1.0f);
          std::fill(y2.begin(), y2.end(), -1.0f);
          rc1 = ref.gemm_int8(f.id, x.data(), m, sh.k, w1.data(), sh.n, y1.data(), threads);
          rc2 = cand.gemm_int8(f.id, x.data(), m, sh.k, w1.data(), sh.n, y2.data(), threads);
          snprintf(what, sizeof what, "%s gemm_int8 m=%lld n=%lld k=%lld threads=%d", f.name, (long long)m,
                   (long long)sh.n, (long long)sh.k, threads);
          report.same(what, &rc1, &rc2, sizeof rc1);
          report.same(what, y1, y2);
        }
      }
    }
  }
  // The largest sums: every weight at its format's largest q (every quant bit set) against activations at +-127
  // (rows of +1, of -1, and blocks alternating), where a backend's narrower partial sums are closest to
  // overflowing (AVX2's int16 pairs of the int8 activations).
  for (const Format& f : FORMATS) {
    const int64_t n = 37, k = 256, m = 6;
    std::vector<uint8_t> src = blocks(f, n, k, rng);
    for (size_t at = 0; at < src.size(); at += (size_t)f.bytes) {
      uint8_t keep[4];
      memcpy(keep, &src[at], 4);
      memset(&src[at], 0xFF, (size_t)f.bytes);
      for (int s : f.scales)
        if (s >= 0) memcpy(&src[at + s], keep + s, 2);
      if (f.id == 39) src[at] = keep[0];  // MXFP4's scale exponent
    }
    std::vector<uint8_t> w((size_t)ref.packed_bytes(f.id, n, k));
    const int rc = ref.pack(f.id, src.data(), n, k, w.data());
    std::vector<float> x((size_t)(m * k));
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < k; ++j) x[i * k + j] = i % 3 == 0 ? 1.0f : i % 3 == 1 ? -1.0f : (j / 32) % 2 ? 1.0f : -1.0f;
    for (int threads = 1; threads <= 2 && rc == 0; ++threads) {
      std::vector<float> y1((size_t)(m * n), -1.0f), y2(y1.size(), -2.0f);
      const int rc1 = ref.gemm_int8(f.id, x.data(), m, k, w.data(), n, y1.data(), threads);
      const int rc2 = cand.gemm_int8(f.id, x.data(), m, k, w.data(), n, y2.data(), threads);
      snprintf(what, sizeof what, "%s largest sums gemm_int8 threads=%d", f.name, threads);
      report.same(what, &rc1, &rc2, sizeof rc1);
      report.same(what, y1, y2);
    }
  }
  // MXFP4 blocks whose scale float16 cannot hold (E - 128 above 15 or below -24) are refused alike; an all-zero
  // block's scale does not matter.
  {
    const Format& f = FORMATS[6];
    for (int e : {255, 144, 103, 0}) {
      std::vector<uint8_t> src = blocks(f, 3, 64, rng);
      src[(size_t)f.bytes] = (uint8_t)e;
      std::vector<uint8_t> w1((size_t)ref.packed_bytes(f.id, 3, 64)), w2(w1.size());
      const int rc1 = ref.pack(f.id, src.data(), 3, 64, w1.data()), rc2 = cand.pack(f.id, src.data(), 3, 64, w2.data());
      snprintf(what, sizeof what, "MXFP4 pack with E=%d", e);
      report.same(what, &rc1, &rc2, sizeof rc1);
      if (rc1 == 0) report.same(what, w1, w2);
    }
  }
  // Unknown formats and k not a multiple of 32.
  {
    std::vector<uint8_t> w(64);
    std::vector<float> x(64), y(4);
    const int codes1[] = {ref.pack(5, w.data(), 1, 32, w.data()),
                          ref.gemm(2, x.data(), 1, 48, w.data(), 1, y.data(), 1),
                          ref.dequantize(99, w.data(), 1, 32, x.data()),
                          ref.gemm_int8(5, x.data(), 1, 32, w.data(), 1, y.data(), 1),
                          ref.gemm_int8(2, x.data(), 1, 48, w.data(), 1, y.data(), 1)};
    const int codes2[] = {cand.pack(5, w.data(), 1, 32, w.data()),
                          cand.gemm(2, x.data(), 1, 48, w.data(), 1, y.data(), 1),
                          cand.dequantize(99, w.data(), 1, 32, x.data()),
                          cand.gemm_int8(5, x.data(), 1, 32, w.data(), 1, y.data(), 1),
                          cand.gemm_int8(2, x.data(), 1, 48, w.data(), 1, y.data(), 1)};
    report.same("error codes", codes1, codes2, sizeof codes1);
  }
  // The activations as the product sees them.
  for (int64_t m : {1, 3, 17})
    for (int64_t k : {32, 96, 512}) {
      const std::vector<float> x = activations(m, k, rng);
      std::vector<int16_t> q1((size_t)(m * k)), q2(q1.size());
      std::vector<float> dq1((size_t)(m * k / 32)), dq2(dq1.size());
      const int rc1 = ref.quantize(x.data(), m, k, q1.data(), dq1.data());
      const int rc2 = cand.quantize(x.data(), m, k, q2.data(), dq2.data());
      snprintf(what, sizeof what, "quantize m=%lld k=%lld", (long long)m, (long long)k);
      report.same(what, &rc1, &rc2, sizeof rc1);
      report.same(what, q1, q2);
      report.same(what, dq1, dq2);
      std::vector<int8_t> b1((size_t)(m * k)), b2(b1.size());
      const int rc3 = ref.quantize_int8(x.data(), m, k, b1.data(), dq1.data());
      const int rc4 = cand.quantize_int8(x.data(), m, k, b2.data(), dq2.data());
      snprintf(what, sizeof what, "quantize_int8 m=%lld k=%lld", (long long)m, (long long)k);
      report.same(what, &rc3, &rc4, sizeof rc3);
      report.same(what, b1, b2);
      report.same(what, dq1, dq2);
    }
}
