// moe_mlp.cpp, two builds bit for bit: the routers (tm_moe_route's softmax top-k, renormalized and top-logits;
// tm_moe_route_grouped's sigmoid groups, renormalized or not) on logits with ties, tails of 16 experts, large and
// infinite values; tm_moe_workspace; and tm_moe_mlp (grouping, biases, the combine; its experts sharing the
// threads or each product on all of them; all experts held or an expert-parallel share; SiLU-and-mul or the
// clamped SwiGLU) at 1..5, 8, 17 and 40 tokens, 1 and 2 threads.
//
// The experts' products and activations are function pointers moe_mlp.cpp is handed. By default both builds get
// this program's own (plain C++, the same code for both): the check is then moe_mlp.cpp's own arithmetic. With
// TM_CHECK_BLOCK_GEMM="REFERENCE.so:CANDIDATE.so" each build gets its own instruction set's block_gemm.cpp
// (tm_block_gemm, float32 rows) for the products, so the two kernels are checked together.
#include "check.h"

// abi.py's structs and pointer types, as tm_abi.h declares them (the library's static_asserts hold its side to
// abi.py; tm_moe_workspace's value below holds this side's offsets of hidden, width and top_k).
extern "C" {
typedef int (*TmGemm)(int fmt, const float* x, int64_t m, int64_t k, const uint8_t* w, int64_t n, float* y,
                      int threads);
typedef void (*TmSiluAndMul)(const float* x, float* out, int64_t t, int64_t n);
typedef void (*TmClampedSwiglu)(const float* x, float* out, int64_t t, int64_t n, float alpha, float limit);
struct TmLinear {
  TmGemm gemm;
  const uint8_t* weights;
  int64_t fmt;
  int64_t out_features;
  const uint8_t* lora_a;
  const uint8_t* lora_bt;
  const int64_t* lora_ranks;
  int64_t lora_rank;
  int64_t lora_parts;
  const int64_t* lora_part_rows;
  int64_t lora_dtype;
  const float* bias;
};
struct TmExperts {
  int64_t hidden, width, top_k, num_experts, first, count;
  const TmLinear* gate_up;
  const TmLinear* down;
  TmSiluAndMul silu_and_mul;
  const float* const* gate_up_bias;
  const float* const* down_bias;
  TmClampedSwiglu clamped_swiglu;
  float swiglu_alpha;
  float swiglu_limit;
};
}

typedef void (*Route)(const float* logits, int64_t t, int64_t experts, int64_t top_k, int64_t routing, float* weights,
                      int64_t* ids);
typedef void (*RouteGrouped)(const float* logits, int64_t t, int64_t experts, int64_t top_k, const float* score_bias,
                             int64_t n_group, int64_t topk_group, int64_t renormalize, float scaling, float* weights,
                             int64_t* ids);
typedef int64_t (*Workspace)(const TmExperts* e, int64_t t, int threads);
typedef int (*Mlp)(const TmExperts* e, const float* x, int64_t t, const int64_t* ids, const float* weights,
                   float* workspace, float* out, int threads);

namespace {

// y [m, n] = x [m, k] @ w [n, k]^T (float32 rows), each output summed in order.
int plain_gemm(int fmt, const float* x, int64_t m, int64_t k, const uint8_t* w, int64_t n, float* y, int) {
  if (fmt != 0) return -1;
  const float* wf = (const float*)w;
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      float acc = 0.0f;
      for (int64_t c = 0; c < k; ++c) acc = fmaf(x[i * k + c], wf[j * k + c], acc);
      y[i * n + j] = acc;
    }
  return 0;
}

void plain_silu_and_mul(const float* x, float* out, int64_t t, int64_t n) {
  for (int64_t i = 0; i < t; ++i)
    for (int64_t j = 0; j < n; ++j) {
      const float g = x[i * 2 * n + j], u = x[i * 2 * n + n + j];
      out[i * n + j] = g / (1.0f + expf(-g)) * u;
    }
}

void plain_clamped_swiglu(const float* x, float* out, int64_t t, int64_t n, float alpha, float limit) {
  for (int64_t i = 0; i < t; ++i)
    for (int64_t j = 0; j < n; ++j) {
      const float g = fminf(x[i * 2 * n + j], limit), u = fmaxf(fminf(x[i * 2 * n + n + j], limit), -limit);
      out[i * n + j] = g / (1.0f + expf(-alpha * g)) * (u + 1.0f);
    }
}

// A product by gemm of float32 rows (ggml's F32 slot), no adapters, no bias.
TmLinear linear(TmGemm gemm, const std::vector<float>& weights, int64_t out_features) {
  TmLinear l;
  memset(&l, 0, sizeof l);
  l.gemm = gemm;
  l.weights = (const uint8_t*)weights.data();
  l.out_features = out_features;
  return l;
}

// Logits of t rows: from `levels` values (ties), or continuous where levels is 0; some rows with extremes.
std::vector<float> logits(int64_t t, int64_t experts, int levels, bool extremes, check::Rng& rng) {
  std::vector<float> v(t * experts);
  for (float& x : v) x = levels ? (float)rng.below(levels) * (3.0f / (float)levels) : rng.normal(2.0f);
  if (extremes && t > 1) {
    v[experts + 1] = 200.0f;            // row 1: one far above the rest (the others' exponentials underflow)
    v[experts] = -INFINITY;
    if (t > 2) v[2 * experts] = -300.0f;  // row 2: one far below
  }
  return v;
}

}  // namespace

CHECK_MAIN("moe_mlp")
void run(const check::Lib& ref, const check::Lib& cand, check::Report& report) {
  check::Rng rng(3);
  char what[200];
  // The routers.
  {
    const Route r1 = ref.fn<Route>("tm_moe_route"), r2 = cand.fn<Route>("tm_moe_route");
    // (experts, top_k): std::partial_sort where top_k * 64 <= experts, else std::nth_element; tails of 16.
    const int64_t shapes[][2] = {{8, 2}, {60, 4}, {64, 8}, {128, 2}, {256, 4}, {16, 1}, {8, 8}, {3, 2}};
    for (const auto& shape : shapes) {
      const int64_t experts = shape[0], top_k = shape[1];
      for (int levels : {2, 5, 0}) {
        for (int64_t t : {1, 2, 3, 4, 5, 8, 17}) {
          const std::vector<float> x = logits(t, experts, levels, levels == 0, rng);
          for (int64_t routing = 0; routing < 3; ++routing) {
            std::vector<float> w1(t * top_k, 1.0f), w2(t * top_k, 2.0f);
            std::vector<int64_t> i1(t * top_k, -1), i2(t * top_k, -2);
            r1(x.data(), t, experts, top_k, routing, w1.data(), i1.data());
            r2(x.data(), t, experts, top_k, routing, w2.data(), i2.data());
            snprintf(what, sizeof what, "route %lld of %lld, routing %lld, levels %d, %lld tokens", (long long)top_k,
                     (long long)experts, (long long)routing, levels, (long long)t);
            report.same(what, w1, w2);
            report.same(what, i1, i2);
          }
        }
      }
    }
    const RouteGrouped g1 = ref.fn<RouteGrouped>("tm_moe_route_grouped"),
                       g2 = cand.fn<RouteGrouped>("tm_moe_route_grouped");
    // (experts, n_group, topk_group, top_k): DeepSeek-V3's 256, 8, 4, 8 among them.
    const int64_t grouped[][4] = {{8, 2, 1, 2},  {8, 4, 2, 3},   {64, 8, 4, 8},
                                  {16, 1, 1, 4}, {256, 8, 4, 8}, {40, 4, 2, 3}};
    for (const auto& g : grouped) {
      const int64_t experts = g[0], n_group = g[1], topk_group = g[2], top_k = g[3];
      std::vector<float> bias(experts);
      for (float& b : bias) b = (float)rng.below(4) * 0.1f;
      for (int levels : {3, 0}) {
        for (int64_t t : {1, 3, 5, 17}) {
          std::vector<float> x = logits(t, experts, levels, levels == 0, rng);
          for (float& v : x) v = levels ? v * (4.0f / 3.0f) - 2.0f : v;
          for (int64_t renormalize : {0, 1}) {
            std::vector<float> w1(t * top_k, 1.0f), w2(t * top_k, 2.0f);
            std::vector<int64_t> i1(t * top_k, -1), i2(t * top_k, -2);
            g1(x.data(), t, experts, top_k, bias.data(), n_group, topk_group, renormalize, 2.5f, w1.data(),
               i1.data());
            g2(x.data(), t, experts, top_k, bias.data(), n_group, topk_group, renormalize, 2.5f, w2.data(),
               i2.data());
            snprintf(what, sizeof what,
                     "grouped %lld of %lld (%lld of %lld groups), renormalize %lld, levels %d, %lld tokens",
                     (long long)top_k, (long long)experts, (long long)topk_group, (long long)n_group,
                     (long long)renormalize, levels, (long long)t);
            report.same(what, w1, w2);
            report.same(what, i1, i2);
          }
        }
      }
    }
  }
  // The experts.
  TmGemm gemm1 = plain_gemm, gemm2 = plain_gemm;
  if (const char* libs = getenv("TM_CHECK_BLOCK_GEMM")) {
    static std::vector<char> paths(libs, libs + strlen(libs) + 1);
    char* colon = strchr(paths.data(), ':');
    if (!colon) {
      fprintf(stderr, "TM_CHECK_BLOCK_GEMM: REFERENCE.so:CANDIDATE.so\n");
      exit(2);
    }
    *colon = 0;
    gemm1 = check::open(paths.data()).fn<TmGemm>("tm_block_gemm");
    gemm2 = check::open(colon + 1).fn<TmGemm>("tm_block_gemm");
    printf("moe_mlp: the products by %s and %s\n", paths.data(), colon + 1);
  }
  const Workspace ws1 = ref.fn<Workspace>("tm_moe_workspace"), ws2 = cand.fn<Workspace>("tm_moe_workspace");
  const Mlp m1 = ref.fn<Mlp>("tm_moe_mlp"), m2 = cand.fn<Mlp>("tm_moe_mlp");
  const int64_t H = 64, W = 96, E = 8, K = 2;
  std::vector<std::vector<float>> gate_up(E, std::vector<float>(2 * W * H)), down(E, std::vector<float>(H * W));
  std::vector<std::vector<float>> gate_up_bias(E, std::vector<float>(2 * W)), down_bias(E, std::vector<float>(H));
  for (int64_t e = 0; e < E; ++e) {
    rng.fill(gate_up[e], 0.15f);
    rng.fill(down[e], 0.1f);
    rng.fill(gate_up_bias[e], 2.0f);
    rng.fill(down_bias[e], 1.0f);
  }
  // (first, count, biases, clamped SwiGLU): every expert; an expert-parallel share; gpt-oss's form.
  const int64_t held[][4] = {{0, E, 0, 0}, {3, 4, 0, 0}, {0, E, 1, 1}, {2, 5, 1, 1}};
  for (const auto& h : held) {
    const int64_t first = h[0], count = h[1];
    const bool biases = h[2], swiglu = h[3];
    std::vector<TmLinear> gu1(count), dn1(count), gu2(count), dn2(count);
    std::vector<const float*> gub(count), dnb(count);
    for (int64_t i = 0; i < count; ++i) {
      const int64_t e = first + i;
      gu1[i] = linear(gemm1, gate_up[e], 2 * W);
      dn1[i] = linear(gemm1, down[e], H);
      gu2[i] = linear(gemm2, gate_up[e], 2 * W);
      dn2[i] = linear(gemm2, down[e], H);
      gub[i] = i % 3 == 1 ? nullptr : gate_up_bias[e].data();  // an expert without biases among those with them
      dnb[i] = i % 3 == 1 ? nullptr : down_bias[e].data();
    }
    TmExperts e1{H, W, K, E, first, count, gu1.data(), dn1.data(), plain_silu_and_mul,
                 biases ? gub.data() : nullptr, biases ? dnb.data() : nullptr,
                 swiglu ? plain_clamped_swiglu : nullptr, 1.702f, 7.0f};
    TmExperts e2 = e1;
    e2.gate_up = gu2.data();
    e2.down = dn2.data();
    for (int64_t t : {1, 2, 3, 4, 5, 8, 17, 40}) {
      std::vector<float> x(t * H), weights(t * K);
      rng.fill(x);
      for (float& w : weights) w = rng.uniform(0.0f, 1.0f);
      std::vector<int64_t> ids(t * K);
      for (int64_t i = 0; i < t; ++i) {
        ids[i * K] = rng.below(E);
        ids[i * K + 1] = (ids[i * K] + 1 + rng.below(E - 1)) % E;  // a token's experts are distinct
      }
      for (int threads : {1, 2}) {
        const int64_t need1 = ws1(&e1, t, threads), need2 = ws2(&e2, t, threads);
        ++report.checks;
        if (need1 != need2 || need1 != t * K * H + threads * t * (H + 3 * W)) {
          fprintf(stderr, "tm_moe_workspace: %lld and %lld floats (want %lld)\n", (long long)need1, (long long)need2,
                  (long long)(t * K * H + threads * t * (H + 3 * W)));
          ++report.failures;
          return;
        }
        std::vector<float> ws(need1), o1(t * H, 1.0f), o2(t * H, 2.0f);
        const int c1 = m1(&e1, x.data(), t, ids.data(), weights.data(), ws.data(), o1.data(), threads);
        const int c2 = m2(&e2, x.data(), t, ids.data(), weights.data(), ws.data(), o2.data(), threads);
        snprintf(what, sizeof what, "experts %lld..%lld%s%s, %lld tokens, %d threads", (long long)first,
                 (long long)(first + count - 1), biases ? ", biases" : "", swiglu ? ", clamped SwiGLU" : "",
                 (long long)t, threads);
        if (c1 != 0 || c2 != 0) {
          fprintf(stderr, "%s: returned %d and %d\n", what, c1, c2);
          ++report.failures;
        }
        report.same(what, o1, o2);
      }
    }
    // An expert id outside the model's: refused (-1) by both.
    const float x[H] = {0}, w[K] = {1.0f, 0.0f};
    const int64_t bad[K] = {0, E};
    std::vector<float> ws(ws1(&e1, 1, 1)), out(H);
    const int c1 = m1(&e1, x, 1, bad, w, ws.data(), out.data(), 1);
    const int c2 = m2(&e2, x, 1, bad, w, ws.data(), out.data(), 1);
    ++report.checks;
    if (c1 != -1 || c2 != -1) {
      fprintf(stderr, "an expert id out of range: returned %d and %d (want -1)\n", c1, c2);
      ++report.failures;
    }
  }
}
