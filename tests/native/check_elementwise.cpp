// elementwise.cpp, two builds against each other: RMSNorm (with and without the residual, strided
// rows), rotary (whole and partial heads), SiLU-, GeGLU- and clamped-SwiGLU-and-mul, over row lengths
// with and without a tail, 1 .. 5, 8 and 17 rows, and inputs that take the activations' every branch:
// NaN, infinities, huge values (exp's clamps), subnormals, zeros of both signs.
#include "check.h"

typedef void (*RmsNorm)(const float*, int64_t, const float*, const float*, float, float*, float*, int64_t, int64_t);
typedef void (*Rotary)(float*, int64_t, int64_t, int64_t, int64_t, int64_t, const int64_t*, const float*, const float*);
typedef void (*AndMul)(const float*, float*, int64_t, int64_t);
typedef void (*ClampedSwiglu)(const float*, float*, int64_t, int64_t, float, float);

static const int64_t ROWS[] = {1, 2, 3, 4, 5, 8, 17};

// Mostly normal values of a few scales; one in `edge_every` an edge value.
static void fill(check::Rng& rng, std::vector<float>& v, float scale, int edge_every) {
  static const float edges[] = {0.0f,   -0.0f,  INFINITY, -INFINITY, NAN,     1e-40f,  -1e-40f, 1e30f,   -1e30f,
                                3.4e38f, -3.4e38f, 87.0f, -87.0f,    87.5f,   -87.5f,  88.0f,   -88.0f,  88.5f,
                                -88.5f, 100.0f, -100.0f, 200.0f,    -200.0f, 7.0f,    -7.0f,   10.0f,   -10.0f,
                                43.6f,  -43.6f, 1e-20f,  -1e-20f};
  for (float& x : v) {
    if (edge_every && rng.below(edge_every) == 0) x = edges[rng.below((int64_t)(sizeof edges / sizeof edges[0]))];
    else x = rng.normal(scale * (float)(1 << rng.below(5)) / 4.0f);
  }
}

static void check_rms_norm(const check::Lib& ref, const check::Lib& cand, check::Report& report, check::Rng& rng) {
  const RmsNorm f = ref.fn<RmsNorm>("tm_rms_norm"), g = cand.fn<RmsNorm>("tm_rms_norm");
  char what[96];
  for (int64_t d : {1, 7, 16, 17, 48, 100, 2048, 2063}) {
    for (int64_t t : ROWS) {
      for (int variant = 0; variant < 3; ++variant) {
        const bool with_residual = variant != 0;
        const int64_t stride = variant == 2 ? d + 5 : d;  // a strided view of wider rows
        const int edges = variant == 2 ? 50 : 0;          // NaN, inf and huge values in one variant
        std::vector<float> x(t * stride), res(t * d), w(d);
        fill(rng, x, 2.0f, edges);
        fill(rng, res, 1.0f, edges);
        fill(rng, w, 1.0f, 0);
        const float eps = variant == 1 ? 1e-5f : 1e-6f;
        std::vector<float> h1(t * d, -1.0f), n1(t * d, -1.0f), h2(t * d, -1.0f), n2(t * d, -1.0f);
        f(x.data(), stride, with_residual ? res.data() : nullptr, w.data(), eps, h1.data(), n1.data(), t, d);
        g(x.data(), stride, with_residual ? res.data() : nullptr, w.data(), eps, h2.data(), n2.data(), t, d);
        snprintf(what, sizeof what, "rms_norm h (d %lld, t %lld, variant %d)", (long long)d, (long long)t, variant);
        report.same(what, h1, h2);
        snprintf(what, sizeof what, "rms_norm normed (d %lld, t %lld, variant %d)", (long long)d, (long long)t, variant);
        report.same(what, n1, n2);
      }
    }
  }
}

static void check_rotary(const check::Lib& ref, const check::Lib& cand, check::Report& report, check::Rng& rng) {
  const Rotary f = ref.fn<Rotary>("tm_rotary"), g = cand.fn<Rotary>("tm_rotary");
  struct Case { int64_t heads, head_dim, rotary_dim, extra; };
  // extra: floats past the heads in each row (a row of q and k together, say).
  const Case cases[] = {{1, 64, 64, 0}, {4, 128, 128, 0}, {3, 96, 24, 7}, {2, 40, 40, 3}, {5, 128, 64, 0},
                        {2, 34, 34, 0}, {8, 64, 32, 16}, {1, 2, 2, 0}};
  const int64_t positions_in_table = 40;
  char what[96];
  for (const Case& c : cases) {
    const int64_t half = c.rotary_dim / 2;
    std::vector<float> cos_t(positions_in_table * half), sin_t(positions_in_table * half);
    for (int64_t p = 0; p < positions_in_table; ++p)
      for (int64_t j = 0; j < half; ++j) {
        const float angle = (float)p * powf(10000.0f, -2.0f * (float)j / (float)c.rotary_dim);
        cos_t[p * half + j] = cosf(angle);
        sin_t[p * half + j] = sinf(angle);
      }
    for (int64_t t : ROWS) {
      const int64_t stride = c.heads * c.head_dim + c.extra;
      std::vector<float> x(t * stride);
      fill(rng, x, 1.0f, 0);
      std::vector<int64_t> positions(t);
      for (int64_t i = 0; i < t; ++i) positions[i] = rng.below(positions_in_table);
      std::vector<float> x1 = x, x2 = x;
      f(x1.data(), stride, t, c.heads, c.head_dim, c.rotary_dim, positions.data(), cos_t.data(), sin_t.data());
      g(x2.data(), stride, t, c.heads, c.head_dim, c.rotary_dim, positions.data(), cos_t.data(), sin_t.data());
      snprintf(what, sizeof what, "rotary (heads %lld, head_dim %lld, rotary_dim %lld, t %lld)", (long long)c.heads,
               (long long)c.head_dim, (long long)c.rotary_dim, (long long)t);
      report.same(what, x1, x2);
    }
  }
}

static void check_activations(const check::Lib& ref, const check::Lib& cand, check::Report& report, check::Rng& rng) {
  const char* names[] = {"tm_silu_and_mul", "tm_gelu_tanh_and_mul"};
  const ClampedSwiglu cf = ref.fn<ClampedSwiglu>("tm_clamped_swiglu_and_mul");
  const ClampedSwiglu cg = cand.fn<ClampedSwiglu>("tm_clamped_swiglu_and_mul");
  // gpt-oss's (1.702, 7), a limit that clamps nothing, and one that is NaN-free but tiny.
  const float swiglu[][2] = {{1.702f, 7.0f}, {1.0f, INFINITY}, {0.5f, 0.25f}};
  char what[112];
  for (int64_t n : {1, 5, 15, 16, 17, 33, 100, 256, 1000}) {
    for (int64_t t : ROWS) {
      for (int edges : {0, 4}) {
        std::vector<float> x(t * 2 * n);
        fill(rng, x, 3.0f, edges);
        std::vector<float> o1(t * n), o2(t * n);
        for (const char* name : names) {
          const AndMul f = ref.fn<AndMul>(name), g = cand.fn<AndMul>(name);
          f(x.data(), o1.data(), t, n);
          g(x.data(), o2.data(), t, n);
          snprintf(what, sizeof what, "%s (n %lld, t %lld, edges %d)", name, (long long)n, (long long)t, edges);
          report.same(what, o1, o2);
        }
        for (const auto& p : swiglu) {
          cf(x.data(), o1.data(), t, n, p[0], p[1]);
          cg(x.data(), o2.data(), t, n, p[0], p[1]);
          snprintf(what, sizeof what, "tm_clamped_swiglu_and_mul (n %lld, t %lld, edges %d, alpha %g, limit %g)",
                   (long long)n, (long long)t, edges, p[0], p[1]);
          report.same(what, o1, o2);
        }
      }
    }
  }
  // Every edge value through every activation, gate and up each (one row of them all, twice over).
  std::vector<float> x(2 * 64);
  fill(rng, x, 1.0f, 1);
  std::vector<float> o1(64), o2(64);
  for (const char* name : names) {
    ref.fn<AndMul>(name)(x.data(), o1.data(), 1, 64);
    cand.fn<AndMul>(name)(x.data(), o2.data(), 1, 64);
    report.same(name, o1, o2);
  }
  cf(x.data(), o1.data(), 1, 64, 1.702f, 7.0f);
  cg(x.data(), o2.data(), 1, 64, 1.702f, 7.0f);
  report.same("tm_clamped_swiglu_and_mul (edges only)", o1, o2);
}

CHECK_MAIN("elementwise")
void run(const check::Lib& ref, const check::Lib& cand, check::Report& report) {
  check::Rng rng(11);
  check_rms_norm(ref, cand, report, rng);
  check_rotary(ref, cand, report, rng);
  check_activations(ref, cand, report, rng);
}
