// paged_attention's exports on two builds: the cache writes (float32 and float16, float16's rounding edges)
// and the attention over float32 and float16 caches, head_dim 64/128/256, grouped query heads, block sizes
// that split columns of 16 keys, prefill chunks (rows 1..5, 8, 17 and past a tile's 48) beside decode
// tokens, sliding windows, soft-capping and attention sinks (-inf: none), threads 1 and 2.
#include "check.h"

typedef void (*StoreKeys)(const float*, int64_t, int64_t, int64_t, int64_t, const int64_t*, void*, int64_t);
typedef void (*StoreValues)(const float*, int64_t, int64_t, int64_t, const int64_t*, void*);
typedef int (*Attention)(const float*, int64_t, int64_t, int64_t, int64_t, const void*, const void*, int64_t,
                         const int64_t*, const int64_t*, const int64_t*, int64_t, float, float*, int);
typedef int (*AttentionWindow)(const float*, int64_t, int64_t, int64_t, int64_t, const void*, const void*, int64_t,
                               const int64_t*, const int64_t*, const int64_t*, int64_t, float, int64_t, float,
                               const float*, float*, int);

namespace {

struct Kernels {
  StoreKeys keys, keys_f16;
  StoreValues values, values_f16;
  Attention plain, plain_f16;
  AttentionWindow window, window_f16;
  explicit Kernels(const check::Lib& lib)
      : keys(lib.fn<StoreKeys>("tm_store_keys")),
        keys_f16(lib.fn<StoreKeys>("tm_store_keys_f16")),
        values(lib.fn<StoreValues>("tm_store_values")),
        values_f16(lib.fn<StoreValues>("tm_store_values_f16")),
        plain(lib.fn<Attention>("tm_paged_attention")),
        plain_f16(lib.fn<Attention>("tm_paged_attention_f16")),
        window(lib.fn<AttentionWindow>("tm_paged_attention_window")),
        window_f16(lib.fn<AttentionWindow>("tm_paged_attention_window_f16")) {}
};

// Values for the float16 stores: normals, float16's subnormals and rounding ties, overflow, infinities, NaN.
float store_value(check::Rng& rng) {
  static const float edges[] = {0.0f, -0.0f, 65504.0f, 65519.0f, 65520.0f, -1e6f, INFINITY, -INFINITY, NAN,
                                6.1035156e-5f, 5.9604645e-8f, 2.9802322e-8f, 3e-8f, 1e-9f, 1.00048828125f,
                                1.00146484375f, -2.00097656f, 1e-40f};
  return rng.below(4) == 0 ? edges[rng.below(sizeof edges / sizeof edges[0])] : rng.normal(4.0f);
}

void check_stores(const Kernels& a, const Kernels& b, check::Report& report, check::Rng& rng) {
  const int64_t shapes[][4] = {{1, 1, 64, 16}, {3, 2, 128, 5}, {5, 4, 64, 24}, {17, 1, 256, 12}};  // t kv D block
  for (const auto& sh : shapes) {
    const int64_t t = sh[0], kv = sh[1], D = sh[2], bs = sh[3], blocks = (t + bs - 1) / bs + 2;
    const int64_t stride = kv * D + 3;  // rows of a wider projection
    std::vector<float> src(t * stride);
    for (float& x : src) x = store_value(rng);
    std::vector<int64_t> slots(t);  // distinct slots, scattered
    std::vector<int64_t> all(blocks * bs);
    for (int64_t i = 0; i < (int64_t)all.size(); ++i) all[i] = i;
    for (int64_t i = 0; i < t; ++i) {
      std::swap(all[i], all[i + rng.below((int64_t)all.size() - i)]);
      slots[i] = all[i];
    }
    const size_t n = blocks * bs * kv * D;
    char what[96];
    {
      std::vector<float> c1(n), c2;
      rng.fill(c1);
      c2 = c1;
      std::vector<float> v1 = c1, v2 = c1;
      a.keys(src.data(), stride, t, kv, D, slots.data(), c1.data(), bs);
      b.keys(src.data(), stride, t, kv, D, slots.data(), c2.data(), bs);
      snprintf(what, sizeof what, "tm_store_keys t=%ld kv=%ld D=%ld block=%ld", (long)t, (long)kv, (long)D, (long)bs);
      report.same(what, c1, c2);
      a.values(src.data(), stride, t, kv * D, slots.data(), v1.data());
      b.values(src.data(), stride, t, kv * D, slots.data(), v2.data());
      snprintf(what, sizeof what, "tm_store_values t=%ld kv=%ld D=%ld", (long)t, (long)kv, (long)D);
      report.same(what, v1, v2);
    }
    {
      std::vector<uint16_t> c1(n);
      for (uint16_t& h : c1) h = (uint16_t)rng.next();
      std::vector<uint16_t> c2 = c1, v1 = c1, v2 = c1;
      a.keys_f16(src.data(), stride, t, kv, D, slots.data(), c1.data(), bs);
      b.keys_f16(src.data(), stride, t, kv, D, slots.data(), c2.data(), bs);
      snprintf(what, sizeof what, "tm_store_keys_f16 t=%ld kv=%ld D=%ld block=%ld", (long)t, (long)kv, (long)D,
               (long)bs);
      report.same(what, c1, c2);
      a.values_f16(src.data(), stride, t, kv * D, slots.data(), v1.data());
      b.values_f16(src.data(), stride, t, kv * D, slots.data(), v2.data());
      snprintf(what, sizeof what, "tm_store_values_f16 t=%ld kv=%ld D=%ld", (long)t, (long)kv, (long)D);
      report.same(what, v1, v2);
    }
  }
}

// One batch: a prefill chunk of `chunk` tokens of sequence 0 ending at its last position, and one decode token
// of each other sequence.
struct Case {
  int64_t D, heads, kv, block, chunk;
  std::vector<int64_t> lengths;  // keys of each sequence (its last token's position + 1)
  int64_t window;
  float softcap;
  int sinks;  // 0: none, 1: random logits, 2: some heads -inf and one dominant
  bool f16;
  float q_scale;  // spread of the queries (peaked softmax: weights below 2^-125)
};

void check_attention(const Kernels& a, const Kernels& b, check::Report& report, check::Rng& rng, const Case& c) {
  const int64_t S = (int64_t)c.lengths.size(), D = c.D, kv = c.kv, bs = c.block;
  int64_t width = 0;
  for (int64_t n : c.lengths) width = std::max(width, (n + bs - 1) / bs);
  const int64_t blocks = S * width + 3;
  // Each sequence's blocks scattered over the pool.
  std::vector<int64_t> perm(blocks);
  for (int64_t i = 0; i < blocks; ++i) perm[i] = i;
  for (int64_t i = blocks - 1; i > 0; --i) std::swap(perm[i], perm[rng.below(i + 1)]);
  std::vector<int64_t> tables(S * width);
  for (int64_t i = 0; i < S * width; ++i) tables[i] = perm[i];
  std::vector<int64_t> positions, seq;
  for (int64_t i = 0; i < c.chunk; ++i) {
    positions.push_back(c.lengths[0] - c.chunk + i);
    seq.push_back(0);
  }
  for (int64_t s = 1; s < S; ++s) {
    positions.push_back(c.lengths[s] - 1);
    seq.push_back(s);
  }
  const int64_t t = (int64_t)positions.size();
  const size_t cache = blocks * bs * kv * D;
  std::vector<float> k32(cache), v32(cache);
  rng.fill(k32);
  rng.fill(v32);
  std::vector<uint16_t> k16(cache), v16(cache);
  for (size_t i = 0; i < cache; ++i) {
    k16[i] = check::half_of(k32[i]);
    v16[i] = check::half_of(v32[i]);
  }
  std::vector<float> q(t * c.heads * D);
  rng.fill(q, c.q_scale);
  std::vector<float> sinks(c.heads);
  for (int64_t h = 0; h < c.heads; ++h)
    sinks[h] = c.sinks == 2 && h % 3 == 0 ? -INFINITY : c.sinks == 2 && h == 1 ? 40.0f : rng.normal(2.0f);
  const void* kc = c.f16 ? (const void*)k16.data() : (const void*)k32.data();
  const void* vc = c.f16 ? (const void*)v16.data() : (const void*)v32.data();
  const float scale = 1.0f / sqrtf((float)D);
  const bool plain = c.window == 0 && c.softcap == 0.0f && c.sinks == 0;
  char what[192];
  for (int threads = 1; threads <= 2; ++threads) {
    std::vector<float> o1(q.size(), -1.0f), o2(q.size(), -2.0f);
    int r1, r2;
    if (plain) {
      const Attention fa = c.f16 ? a.plain_f16 : a.plain, fb = c.f16 ? b.plain_f16 : b.plain;
      r1 = fa(q.data(), t, c.heads, kv, D, kc, vc, bs, positions.data(), seq.data(), tables.data(), width, scale,
              o1.data(), threads);
      r2 = fb(q.data(), t, c.heads, kv, D, kc, vc, bs, positions.data(), seq.data(), tables.data(), width, scale,
              o2.data(), threads);
    } else {
      const AttentionWindow fa = c.f16 ? a.window_f16 : a.window, fb = c.f16 ? b.window_f16 : b.window;
      const float* sp = c.sinks ? sinks.data() : nullptr;
      r1 = fa(q.data(), t, c.heads, kv, D, kc, vc, bs, positions.data(), seq.data(), tables.data(), width, scale,
              c.window, c.softcap, sp, o1.data(), threads);
      r2 = fb(q.data(), t, c.heads, kv, D, kc, vc, bs, positions.data(), seq.data(), tables.data(), width, scale,
              c.window, c.softcap, sp, o2.data(), threads);
    }
    snprintf(what, sizeof what,
             "%s D=%ld heads=%ld/%ld block=%ld chunk=%ld of %ld, %ld seqs, window=%ld softcap=%g sinks=%d q*%g "
             "threads=%d",
             c.f16 ? "f16" : "f32", (long)D, (long)c.heads, (long)kv, (long)bs, (long)c.chunk, (long)c.lengths[0],
             (long)S, (long)c.window, c.softcap, c.sinks, c.q_scale, threads);
    if (r1 != 0 || r2 != 0) {
      fprintf(stderr, "%s: returned %d and %d\n", what, r1, r2);
      ++report.failures;
      continue;
    }
    report.same(what, o1, o2);
  }
}

}  // namespace

CHECK_MAIN("paged_attention")
void run(const check::Lib& ref, const check::Lib& cand, check::Report& report) {
  const Kernels a(ref), b(cand);
  check::Rng rng(11);
  check_stores(a, b, report, rng);

  // Refusals: head_dim not 64/128/256 (-1), heads not a multiple of kv_heads (-2).
  {
    std::vector<float> q(2 * 96), o(2 * 96), cache(16 * 96);
    const int64_t pos = 0, seq = 0, table = 0;
    auto call = [&](Attention f, int64_t heads, int64_t kv, int64_t d) {
      return f(q.data(), 1, heads, kv, d, cache.data(), cache.data(), 16, &pos, &seq, &table, 1, 1.0f, o.data(), 1);
    };
    const int r1 = call(a.plain, 2, 1, 96), r2 = call(b.plain, 2, 1, 96);
    const int r3 = call(a.plain, 3, 2, 64), r4 = call(b.plain, 3, 2, 64);
    if (r1 != -1 || r2 != -1 || r3 != -2 || r4 != -2) {
      fprintf(stderr, "refusals: %d %d %d %d (want -1 -1 -2 -2)\n", r1, r2, r3, r4);
      ++report.failures;
    }
  }

  // {D, heads, kv, block, chunk, lengths, window, softcap, sinks, f16, q_scale}
  const Case cases[] = {
      // Decode tokens only (rows = the group: 1, 2, 4, 8), float32 and float16, blocks of 16 and splitting ones.
      {64, 4, 4, 16, 0, {1, 37, 100, 16}, 0, 0.0f, 0, false, 1.0f},
      {64, 8, 4, 5, 0, {1, 29, 77}, 0, 0.0f, 0, true, 1.0f},
      {128, 8, 2, 12, 0, {1, 150, 3}, 0, 0.0f, 0, false, 1.0f},
      {256, 8, 1, 24, 0, {1, 70, 33}, 0, 0.0f, 0, true, 1.0f},
      // Prefill chunks: rows 1..5, 8, 17 of one head, and groups of 3, 4, 16 (past 48 rows: two passes).
      {64, 1, 1, 16, 1, {40}, 0, 0.0f, 0, false, 1.0f},
      {64, 1, 1, 7, 2, {41}, 0, 0.0f, 0, true, 1.0f},
      {128, 1, 1, 16, 3, {66, 20}, 0, 0.0f, 0, false, 1.0f},
      {64, 1, 1, 40, 4, {90}, 0, 0.0f, 0, false, 1.0f},
      {256, 1, 1, 16, 5, {35, 7}, 0, 0.0f, 0, true, 1.0f},
      {64, 2, 2, 12, 8, {100}, 0, 0.0f, 0, false, 1.0f},
      {128, 2, 1, 16, 17, {60, 18}, 0, 0.0f, 0, true, 1.0f},
      {64, 6, 2, 16, 20, {120, 50}, 0, 0.0f, 0, false, 1.0f},
      {128, 8, 2, 32, 13, {80}, 0, 0.0f, 0, false, 1.0f},
      {256, 16, 1, 16, 5, {50, 20}, 0, 0.0f, 0, false, 1.0f},
      {64, 4, 1, 16, 30, {30, 5}, 0, 0.0f, 0, true, 1.0f},  // the chunk from key 0
      // A peaked softmax: weights clamped at 2^-125.
      {64, 4, 2, 16, 6, {90, 40}, 0, 0.0f, 0, false, 12.0f},
      // Sliding windows (1 key, shorter and longer than the context), soft-capping, sinks, and all at once.
      {64, 4, 2, 16, 9, {70, 40}, 1, 0.0f, 0, false, 1.0f},
      {128, 4, 2, 5, 12, {100, 9, 61}, 7, 0.0f, 0, true, 1.0f},
      {64, 2, 1, 24, 17, {130}, 33, 0.0f, 0, false, 1.0f},
      {256, 4, 2, 16, 4, {90, 300}, 100, 0.0f, 0, false, 1.0f},
      {64, 4, 2, 16, 9, {70, 40}, 0, 5.0f, 0, false, 4.0f},
      {256, 8, 4, 12, 6, {60, 25}, 0, 50.0f, 0, true, 2.0f},
      {128, 8, 2, 16, 5, {57, 33}, 20, 30.0f, 0, false, 3.0f},
      {64, 8, 2, 16, 7, {64, 1, 19}, 0, 0.0f, 1, false, 1.0f},
      {128, 6, 3, 7, 3, {45, 80}, 0, 0.0f, 2, true, 1.0f},
      {64, 8, 8, 16, 11, {75, 12}, 16, 0.0f, 2, false, 1.0f},
      {256, 4, 1, 20, 5, {66, 40}, 24, 20.0f, 1, false, 2.0f},
      {64, 12, 4, 9, 6, {48, 100}, 5, 10.0f, 2, true, 8.0f},
  };
  for (const Case& c : cases) check_attention(a, b, report, rng, c);
}
