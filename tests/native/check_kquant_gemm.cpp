// kquant_gemm.cpp, two builds side by side: every exported function (tm_kquant_packed_bytes, _pack, _gemm,
// _dequantize) on the same pseudo-random super-blocks of every k-quant and a mixed (segmented) layer, for
// row counts that take each tile (digits up to 4 rows, words above), group counts with a tail of rows,
// one and two threads, and the error returns; the products with 16-bit and with 8-bit activations
// (tm_kquant_gemm_int8).
#include "check.h"

typedef int64_t (*PackedBytes)(int, int64_t, int64_t);
typedef int (*Pack)(int, const uint8_t*, int64_t, int64_t, uint8_t*);
typedef int (*Gemm)(int, const float*, int64_t, int64_t, const uint8_t*, int64_t, float*, int);
typedef int (*Dequantize)(int, const uint8_t*, int64_t, int64_t, float*);

namespace {

// abi.py's ggml type ids, bytes per super-block of 256 and where its float16 scales sit (d, then dmin).
struct Format {
  const char* name;
  int id;
  int64_t bytes;
  int scale_at[2];
};
const Format FORMATS[] = {
    {"Q2_K", 10, 84, {80, 82}},   {"Q3_K", 11, 110, {108, -1}}, {"Q4_K", 12, 144, {0, 2}},
    {"Q5_K", 13, 176, {0, 2}},    {"Q6_K", 14, 210, {208, -1}}, {"IQ4_XS", 23, 136, {0, -1}},
};
constexpr int MIXED = 255;           // TM_KQUANT_MIXED
constexpr int64_t HEADER_BYTES = 128;  // TM_KQUANT_HEADER_BYTES

struct Kernel {
  PackedBytes packed_bytes;
  Pack pack;
  Gemm gemm;
  Dequantize dequantize;
  Gemm gemm_int8;
  explicit Kernel(const check::Lib& lib)
      : packed_bytes(lib.fn<PackedBytes>("tm_kquant_packed_bytes")),
        pack(lib.fn<Pack>("tm_kquant_pack")),
        gemm(lib.fn<Gemm>("tm_kquant_gemm")),
        dequantize(lib.fn<Dequantize>("tm_kquant_dequantize")),
        gemm_int8(lib.fn<Gemm>("tm_kquant_gemm_int8")) {}
};

// n rows of k weights as random super-blocks, their scales small float16 (a weight a few hundredths).
std::vector<uint8_t> source(const Format& f, int64_t n, int64_t k, check::Rng& rng) {
  std::vector<uint8_t> blocks(n * (k / 256) * f.bytes);
  rng.fill_bytes(blocks);
  for (size_t at = 0; at < blocks.size(); at += f.bytes)
    for (int s : f.scale_at) {
      if (s < 0) continue;
      const uint16_t h = check::half_of(rng.uniform(-0.01f, 0.01f));
      memcpy(&blocks[at + s], &h, 2);
    }
  return blocks;
}

// Activations: mostly normal, with a zero block, a block far below 1 (its unit's reciprocal overflows) and one
// with a large value, so that the fixed point's edges are taken.
std::vector<float> activations(int64_t m, int64_t k, check::Rng& rng) {
  std::vector<float> x(m * k);
  rng.fill(x);
  if (m > 2) {
    for (int64_t j = 0; j < 32; ++j) x[k + j] = 0.0f;
    for (int64_t j = 32; j < 64; ++j) x[k + j] *= 1e-38f;
    x[2 * k + 70] = 3e4f;
  }
  return x;
}

// Packs on both builds; the packed bytes must agree (the candidate's are what both multiply from then on, so
// that a difference in the products is the products').
std::vector<uint8_t> pack_both(const Kernel& a, const Kernel& b, int fmt, const std::vector<uint8_t>& src, int64_t n,
                               int64_t k, check::Report& report, const char* what) {
  const int64_t bytes = a.packed_bytes(fmt, n, k);
  const int64_t bytes_b = b.packed_bytes(fmt, n, k);
  report.same(what, &bytes, &bytes_b, sizeof bytes, 1);
  std::vector<uint8_t> pa(bytes), pb(bytes);
  const int ra = a.pack(fmt, src.data(), n, k, pa.data()), rb = b.pack(fmt, src.data(), n, k, pb.data());
  report.same(what, &ra, &rb, sizeof ra);
  report.same(what, pa, pb);
  return pb;
}

// Every row count and thread count on one packed weight.
void products(const Kernel& a, const Kernel& b, int fmt, const std::vector<uint8_t>& w, int64_t n, int64_t k,
              check::Rng& rng, check::Report& report, const char* name) {
  static const int64_t rows[] = {1, 2, 3, 4, 5, 8, 17, 24};  // 12 and 18 up: AVX2 unpacks ahead
  char what[96];
  for (int64_t m : rows)
    for (int threads = 1; threads <= 2; ++threads) {
      const std::vector<float> x = activations(m, k, rng);
      std::vector<float> ya(m * n, -1.0f), yb(m * n, -2.0f);
      const int ra = a.gemm(fmt, x.data(), m, k, w.data(), n, ya.data(), threads);
      const int rb = b.gemm(fmt, x.data(), m, k, w.data(), n, yb.data(), threads);
      snprintf(what, sizeof what, "%s gemm m=%lld k=%lld n=%lld threads=%d", name, (long long)m, (long long)k,
               (long long)n, threads);
      report.same(what, &ra, &rb, sizeof ra);
      report.same(what, ya, yb);
      std::vector<float> ia(m * n, -1.0f), ib(m * n, -2.0f);
      const int ia_rc = a.gemm_int8(fmt, x.data(), m, k, w.data(), n, ia.data(), threads);
      const int ib_rc = b.gemm_int8(fmt, x.data(), m, k, w.data(), n, ib.data(), threads);
      snprintf(what, sizeof what, "%s gemm_int8 m=%lld k=%lld n=%lld threads=%d", name, (long long)m, (long long)k,
               (long long)n, threads);
      report.same(what, &ia_rc, &ib_rc, sizeof ia_rc);
      report.same(what, ia, ib);
    }
  std::vector<float> da(n * k), db(n * k);
  const int ra = a.dequantize(fmt, w.data(), n, k, da.data()), rb = b.dequantize(fmt, w.data(), n, k, db.data());
  snprintf(what, sizeof what, "%s dequantize k=%lld n=%lld", name, (long long)k, (long long)n);
  report.same(what, &ra, &rb, sizeof ra);
  report.same(what, da, db);
}

}  // namespace

CHECK_MAIN("kquant_gemm")
void run(const check::Lib& ref, const check::Lib& cand, check::Report& report) {
  const Kernel a(ref), b(cand);
  check::Rng rng(11);
  char what[96];
  // n: one group, a tail (3 groups, the last of 5 rows: a two-group tile and a one-group one), 48 rows whole.
  static const int64_t shapes[][2] = {{256, 16}, {512, 37}, {768, 48}};
  for (const Format& f : FORMATS)
    for (const auto& shape : shapes) {
      const int64_t k = shape[0], n = shape[1];
      snprintf(what, sizeof what, "%s pack k=%lld n=%lld", f.name, (long long)k, (long long)n);
      const std::vector<uint8_t> w = pack_both(a, b, f.id, source(f, n, k, rng), n, k, report, what);
      products(a, b, f.id, w, n, k, rng, report, f.name);
    }

  // The largest sums: every weight at its format's largest q (all bits set) against activations at +-127 (rows of
  // +1 and of -1: a block's int8 values all +127 or all -127), where a backend's narrower partial sums are closest
  // to overflowing (AVX2's int16 pairs of the int8 activations).
  for (const Format& f : FORMATS) {
    const int64_t k = 512, n = 37, m = 6;
    std::vector<uint8_t> src = source(f, n, k, rng);
    for (size_t at = 0; at < src.size(); at += f.bytes) {
      std::vector<uint16_t> halves;
      for (int s : f.scale_at)
        if (s >= 0) halves.push_back((uint16_t)(src[at + s] | src[at + s + 1] << 8));
      memset(&src[at], 0xFF, f.bytes);
      size_t h = 0;
      for (int s : f.scale_at)
        if (s >= 0) memcpy(&src[at + s], &halves[h++], 2);
    }
    snprintf(what, sizeof what, "%s largest sums pack", f.name);
    const std::vector<uint8_t> w = pack_both(a, b, f.id, src, n, k, report, what);
    std::vector<float> x(m * k);
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < k; ++j) x[i * k + j] = i % 3 == 0 ? 1.0f : i % 3 == 1 ? -1.0f : (j / 32) % 2 ? 1.0f : -1.0f;
    for (int threads = 1; threads <= 2; ++threads) {
      std::vector<float> ya(m * n, -1.0f), yb(m * n, -2.0f);
      const int ra = a.gemm_int8(f.id, x.data(), m, k, w.data(), n, ya.data(), threads);
      const int rb = b.gemm_int8(f.id, x.data(), m, k, w.data(), n, yb.data(), threads);
      snprintf(what, sizeof what, "%s largest sums gemm_int8 threads=%d", f.name, threads);
      report.same(what, &ra, &rb, sizeof ra);
      report.same(what, ya, yb);
      const int rc = a.gemm(f.id, x.data(), m, k, w.data(), n, ya.data(), threads);
      const int rd = b.gemm(f.id, x.data(), m, k, w.data(), n, yb.data(), threads);
      snprintf(what, sizeof what, "%s largest sums gemm threads=%d", f.name, threads);
      report.same(what, &rc, &rd, sizeof rc);
      report.same(what, ya, yb);
    }
  }

  // A mixed layer: Q4_K, Q6_K and IQ4_XS segments (whole groups but the last), behind abi.py's header.
  {
    const int64_t k = 512;
    const int ids[] = {12, 14, 23};
    const int64_t seg_rows[] = {32, 16, 21};
    const int64_t n = 32 + 16 + 21;
    int64_t header[1 + 3 * 3] = {3};
    std::vector<uint8_t> w(HEADER_BYTES);
    for (int s = 0; s < 3; ++s) {
      const Format* f = nullptr;
      for (const Format& g : FORMATS)
        if (g.id == ids[s]) f = &g;
      snprintf(what, sizeof what, "mixed segment %d pack", s);
      const std::vector<uint8_t> packed = pack_both(a, b, f->id, source(*f, seg_rows[s], k, rng), seg_rows[s], k,
                                                    report, what);
      header[1 + 3 * s] = ids[s];
      header[2 + 3 * s] = seg_rows[s];
      header[3 + 3 * s] = (int64_t)w.size();
      w.insert(w.end(), packed.begin(), packed.end());
      w.resize((w.size() + 63) / 64 * 64);
    }
    memcpy(w.data(), header, sizeof header);
    products(a, b, MIXED, w, n, k, rng, report, "mixed");
    // A header that does not add up to n rows, and one that splits a group between formats: -3.
    std::vector<float> x(k), ya(n, 0.0f), yb(n, 0.0f);
    const int bad_a = a.gemm(MIXED, x.data(), 1, k, w.data(), n + 1, ya.data(), 1);
    const int bad_b = b.gemm(MIXED, x.data(), 1, k, w.data(), n + 1, yb.data(), 1);
    report.same("mixed: rows not adding up", &bad_a, &bad_b, sizeof bad_a);
    header[2] = 30;
    header[5] = 18;
    memcpy(w.data(), header, sizeof header);
    const int split_a = a.gemm(MIXED, x.data(), 1, k, w.data(), n, ya.data(), 1);
    const int split_b = b.gemm(MIXED, x.data(), 1, k, w.data(), n, yb.data(), 1);
    report.same("mixed: a group split", &split_a, &split_b, sizeof split_a);
  }

  // Errors: an unknown format (-1), k not a multiple of 256 (-2), for each function.
  {
    const std::vector<uint8_t> src(2 * 210), out(4096);
    std::vector<float> x(2 * 256), y(64);
    const int64_t r[] = {
        a.packed_bytes(99, 16, 256), b.packed_bytes(99, 16, 256),
        a.pack(99, src.data(), 1, 256, (uint8_t*)out.data()), b.pack(99, src.data(), 1, 256, (uint8_t*)out.data()),
        a.pack(14, src.data(), 1, 200, (uint8_t*)out.data()), b.pack(14, src.data(), 1, 200, (uint8_t*)out.data()),
        a.gemm(99, x.data(), 1, 256, out.data(), 16, y.data(), 1), b.gemm(99, x.data(), 1, 256, out.data(), 16, y.data(), 1),
        a.gemm(14, x.data(), 1, 200, out.data(), 16, y.data(), 1), b.gemm(14, x.data(), 1, 200, out.data(), 16, y.data(), 1),
        a.gemm_int8(99, x.data(), 1, 256, out.data(), 16, y.data(), 1),
        b.gemm_int8(99, x.data(), 1, 256, out.data(), 16, y.data(), 1),
        a.gemm_int8(14, x.data(), 1, 200, out.data(), 16, y.data(), 1),
        b.gemm_int8(14, x.data(), 1, 200, out.data(), 16, y.data(), 1),
        a.dequantize(99, out.data(), 1, 256, y.data()), b.dequantize(99, out.data(), 1, 256, y.data()),
        a.dequantize(14, out.data(), 1, 200, y.data()), b.dequantize(14, out.data(), 1, 200, y.data()),
    };
    for (size_t i = 0; i < sizeof r / sizeof r[0]; i += 2) {
      snprintf(what, sizeof what, "error return %zu", i / 2);
      report.same(what, &r[i], &r[i + 1], sizeof r[i], 1);
    }
  }
}
