// A mixture-of-experts MLP's experts in one native call: the step's (token, rank) pairs grouped by
// expert, each held expert's gate/up product (plus its bias, where the family has them), activation
// (SiLU-and-mul, or gpt-oss's clamped SwiGLU) and down product (plus bias) on its group's rows,
// and each token's outputs summed in the order of its own ranks. The same kernels on the same rows
// in the same order as worker/layers/fused_moe/layer.py's loop, so the same bits, without the ~50 Python
// calls and tensors a layer of top-8 routing costs there per step (more than the experts' arithmetic
// at one decoding sequence).
//
// Threads: where the step's experts can keep every thread busy (at least two a thread), each expert
// runs whole on one thread, its products single-threaded; otherwise the experts run one after the
// other, each product on every thread. The products' bits do not depend on the thread count
// (every kernel's promise), so neither does the result.
// The combine must round each product and each sum as torch's separate mul and add do: no fused
// multiply-add (build.py compiles every kernel with -ffp-contract=off). The routers' exponentials are
// simd.h's exp, not libm's expf (whose last bit differs between libraries and machines): a token's
// choice and weights are the same bits on every CPU.

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "simd.h"
#include "tm_abi.h"  // TmExperts, TmLinear, the kernels' pointer types and this file's prototypes

namespace {

// torch.topk's order (ATen/native/TopKImpl.h, CPU): the larger first, NaN above everything.
inline bool larger(const std::pair<double, int64_t>& x, const std::pair<double, int64_t>& y) {
  return (isnan(x.first) && !isnan(y.first)) || x.first > y.first;
}

// out = softmax(x) over n values in float32: the maximum subtracted, the exponentials (simd::exp, 16 at a
// time: each lane's bits are exp_one's) summed in order, each multiplied by the sum's reciprocal (out may be x).
inline void softmax(const float* x, int64_t n, float* out) {
  float top = x[0];
  for (int64_t e = 1; e < n; ++e) top = x[e] > top ? x[e] : top;
  for (int64_t e = 0; e < n; e += 16) {
    const simd::lanes m = simd::first_lanes(n - e);
    simd::store_masked(out + e, m, simd::exp(simd::sub(simd::load_masked(x + e, m), simd::set1(top))));
  }
  float sum = 0.0f;
  for (int64_t e = 0; e < n; ++e) sum += out[e];
  const float inv = 1.0f / sum;
  for (int64_t e = 0; e < n; ++e) out[e] = out[e] * inv;
}

// The k largest of the (value, index) pairs first, by rank, as torch.topk ranks them on the CPU: the same
// selection algorithm (std::partial_sort where k * 64 <= n, else std::nth_element and a sort of the first
// k - 1) on the same pairs, so the same indices where values tie.
inline void select_top(std::vector<std::pair<double, int64_t>>& queue, int64_t k) {
  const int64_t n = (int64_t)queue.size();
  if (k * 64 <= n) {
    std::partial_sort(queue.begin(), queue.begin() + k, queue.end(), larger);
  } else {
    std::nth_element(queue.begin(), queue.begin() + k - 1, queue.end(), larger);
    std::sort(queue.begin(), queue.begin() + k - 1, larger);
  }
}

// y[r, :] += bias for each of n rows of `cols`: a linear layer's ``y + self.bias``, one rounding each.
inline void add_bias(float* y, int64_t n, int64_t cols, const float* bias) {
  for (int64_t r = 0; r < n; ++r)
    for (int64_t j = 0; j < cols; ++j) y[r * cols + j] = y[r * cols + j] + bias[j];
}

}  // namespace

extern "C" {

// The router's choice for each of t tokens (worker/kernels/moe_routing.py's ``select_experts`` and
// ``select_top_logits``, computed here for the native ops and the decoder stack alike), by `routing`
// (TM_ROUTING_*): softmax over the row's `experts` logits in float32 (the maximum subtracted, the
// exponentials summed in expert order), the top_k largest probabilities by rank, divided by their sum
// (in rank order) where RENORMALIZED; or (TOP_LOGITS, gpt-oss) the top_k largest logits by rank, then a
// softmax over those (the largest subtracted, the exponentials summed in rank order). Equal values are
// ranked as torch.topk ranks them: the same selection algorithm on the same (value, index) pairs
// (std::partial_sort where top_k * 64 <= experts, else std::nth_element and a sort of the first
// top_k - 1), so the same expert ids. Each row on its own: batch-invariant.
void tm_moe_route(const float* logits, int64_t t, int64_t experts, int64_t top_k, int64_t routing,
                  float* weights, int64_t* ids) {
  std::vector<float> probs(experts);
  std::vector<std::pair<double, int64_t>> queue(experts);
  for (int64_t i = 0; i < t; ++i) {
    const float* x = logits + i * experts;
    if (routing == TM_ROUTING_TOP_LOGITS) {
      for (int64_t e = 0; e < experts; ++e) queue[e] = {(double)x[e], e};
    } else {
      softmax(x, experts, probs.data());
      for (int64_t e = 0; e < experts; ++e) queue[e] = {(double)probs[e], e};
    }
    select_top(queue, top_k);
    float* w = weights + i * top_k;
    for (int64_t r = 0; r < top_k; ++r) {
      w[r] = (float)queue[r].first;
      ids[i * top_k + r] = queue[r].second;
    }
    if (routing == TM_ROUTING_TOP_LOGITS) {
      softmax(w, top_k, w);
    } else if (routing == TM_ROUTING_RENORMALIZED) {
      float chosen = 0.0f;
      for (int64_t r = 0; r < top_k; ++r) chosen += w[r];
      for (int64_t r = 0; r < top_k; ++r) w[r] = w[r] / chosen;
    }
  }
}

// DeepSeek-V3's group-limited sigmoid routing for each of t tokens (worker/kernels/moe_routing.py's
// ``select_experts_grouped``, computed here for the native ops and the decoder stack alike): each logit's
// sigmoid in float32 (as softmax((x, 0))[0]: the larger of x and 0 subtracted, each exponential times the
// reciprocal of their sum); the choice score its sigmoid plus score_bias; the experts in n_group equal
// groups (consecutive ids), each scored by the sum of its two largest choice scores; the topk_group best
// groups kept; the top_k largest choice scores among their experts, by rank; each chosen expert's weight
// its sigmoid, divided by (their sum in rank order + 1e-20) where `renormalize`, times `scaling`. Every
// choice ranked as torch.topk ranks it (select_top). Each row on its own: batch-invariant.
void tm_moe_route_grouped(const float* logits, int64_t t, int64_t experts, int64_t top_k, const float* score_bias,
                          int64_t n_group, int64_t topk_group, int64_t renormalize, float scaling, float* weights,
                          int64_t* ids) {
  const int64_t per_group = experts / n_group;
  std::vector<float> scores(experts), choice(experts);
  std::vector<std::pair<double, int64_t>> queue(experts), groups(n_group), pair(per_group);
  std::vector<char> kept(n_group);
  for (int64_t i = 0; i < t; ++i) {
    const float* x = logits + i * experts;
    // 16 experts at a time: top = x > 0 ? x : 0 (simd::max's), a = e^(x - top), b = e^(0 - top),
    // score = a * (1 / (a + b)), choice = score + bias, one rounding each as written.
    for (int64_t e = 0; e < experts; e += 16) {
      using namespace simd;
      const lanes m = first_lanes(experts - e);
      const f32x16 v = load_masked(x + e, m), top = max(v, zero_f());
      const f32x16 a = exp(sub(v, top)), b = exp(sub(zero_f(), top));
      const f32x16 score = mul(a, div(set1(1.0f), add(a, b)));
      store_masked(scores.data() + e, m, score);
      store_masked(choice.data() + e, m, add(score, load_masked(score_bias + e, m)));
    }
    for (int64_t g = 0; g < n_group; ++g) {
      for (int64_t j = 0; j < per_group; ++j) pair[j] = {(double)choice[g * per_group + j], j};
      select_top(pair, 2);
      groups[g] = {(double)((float)pair[0].first + (float)pair[1].first), g};
      kept[g] = 0;
    }
    select_top(groups, topk_group);
    for (int64_t r = 0; r < topk_group; ++r) kept[groups[r].second] = 1;
    for (int64_t e = 0; e < experts; ++e) queue[e] = {kept[e / per_group] ? (double)choice[e] : -INFINITY, e};
    select_top(queue, top_k);
    float* w = weights + i * top_k;
    for (int64_t r = 0; r < top_k; ++r) {
      ids[i * top_k + r] = queue[r].second;
      w[r] = scores[queue[r].second];
    }
    if (renormalize) {
      float chosen = 0.0f;
      for (int64_t r = 0; r < top_k; ++r) chosen += w[r];
      chosen = chosen + 1e-20f;
      for (int64_t r = 0; r < top_k; ++r) w[r] = w[r] / chosen;
    }
    for (int64_t r = 0; r < top_k; ++r) w[r] = w[r] * scaling;
  }
}

// Floats of workspace a step of t tokens needs with `threads` threads: every pair's output, and each
// thread's rows of one expert (gathered inputs, gate/up, activation).
int64_t tm_moe_workspace(const TmExperts* e, int64_t t, int threads) {
  const int64_t pairs = t * e->top_k;
  return pairs * e->hidden + (int64_t)threads * t * (e->hidden + 3 * e->width);
}

// x [t, hidden]; ids [t, top_k] (expert ids, any of the model's), weights [t, top_k] float32, by
// rank; out [t, hidden] = sum over ranks r in order of weights[:, r] * expert(ids[:, r])(x), the terms
// of experts not held here zero. Returns 0, or the failing product's code.
int tm_moe_mlp(const TmExperts* e, const float* x, int64_t t, const int64_t* ids, const float* weights,
               float* workspace, float* out, int threads) {
  const int64_t H = e->hidden, W = e->width, K = e->top_k, pairs = t * K;
  // Pairs grouped by expert, stable (token-major within a group), as the Python loop's argsort.
  std::vector<int64_t> start(e->num_experts + 1, 0), order(pairs), slot(pairs);
  for (int64_t p = 0; p < pairs; ++p) {
    if (ids[p] < 0 || ids[p] >= e->num_experts) return -1;
    ++start[ids[p] + 1];
  }
  for (int64_t i = 0; i < e->num_experts; ++i) start[i + 1] += start[i];
  {
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (int64_t p = 0; p < pairs; ++p) {
      const int64_t at = fill[ids[p]]++;
      order[at] = p;
      slot[p] = at;
    }
  }
  float* pair_out = workspace;  // [pairs, H], in grouped order: an expert's rows are contiguous
  float* scratch = pair_out + pairs * H;
  std::vector<int64_t> active;  // held experts with rows this step
  for (int64_t i = 0; i < e->count; ++i) {
    const int64_t id = e->first + i;
    if (start[id + 1] > start[id]) active.push_back(i);
  }
  // Pairs routed to experts held elsewhere contribute zero (expert parallelism).
  for (int64_t id = 0; id < e->num_experts; ++id)
    if ((id < e->first || id >= e->first + e->count) && start[id + 1] > start[id])
      memset(pair_out + start[id] * H, 0, (start[id + 1] - start[id]) * H * sizeof(float));

  auto run = [&](int64_t i, float* mine, int product_threads) -> int {
    const int64_t id = e->first + i, n = start[id + 1] - start[id];
    float* xs = mine;                // [n, H]
    float* gate_up = xs + n * H;     // [n, 2W]
    float* act = gate_up + n * 2 * W;  // [n, W]
    for (int64_t r = 0; r < n; ++r) memcpy(xs + r * H, x + (order[start[id] + r] / K) * H, H * sizeof(float));
    const TmLinear& gu = e->gate_up[i];
    const TmLinear& dn = e->down[i];
    float* y = pair_out + start[id] * H;
    if (gu.gemm((int)gu.fmt, xs, n, H, gu.weights, 2 * W, gate_up, product_threads)) return 1;
    if (e->gate_up_bias && e->gate_up_bias[i]) add_bias(gate_up, n, 2 * W, e->gate_up_bias[i]);
    if (e->clamped_swiglu)
      e->clamped_swiglu(gate_up, act, n, W, e->swiglu_alpha, e->swiglu_limit);
    else
      e->silu_and_mul(gate_up, act, n, W);
    if (dn.gemm((int)dn.fmt, act, n, W, dn.weights, H, y, product_threads)) return 1;
    if (e->down_bias && e->down_bias[i]) add_bias(y, n, H, e->down_bias[i]);
    return 0;
  };
  const int64_t n_active = (int64_t)active.size();
  int failed = 0;
  if (threads > 1 && n_active >= 2 * threads) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) reduction(| : failed)
    for (int64_t a = 0; a < n_active; ++a)
      failed |= run(active[a], scratch + omp_get_thread_num() * t * (H + 3 * W), 1);
  } else {
    for (int64_t a = 0; a < n_active && !failed; ++a) failed |= run(active[a], scratch, threads);
  }
  if (failed) return -2;
  // out = w0 * o0, then + w_r * o_r for r = 1 .. K - 1: each token's own ranks' order.
  for (int64_t i = 0; i < t; ++i) {
    float* y = out + i * H;
    const float* o = pair_out + slot[i * K] * H;
    const float w = weights[i * K];
    for (int64_t j = 0; j < H; ++j) y[j] = o[j] * w;
    for (int64_t r = 1; r < K; ++r) {
      const float* o_r = pair_out + slot[i * K + r] * H;
      const float w_r = weights[i * K + r];
      for (int64_t j = 0; j < H; ++j) y[j] = y[j] + o_r[j] * w_r;
    }
  }
  return 0;
}
}
