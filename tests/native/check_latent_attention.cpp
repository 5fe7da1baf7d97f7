// latent_attention.cpp, two builds against each other: float32 and float16 caches, the up-projections
// as copies and as views of kv_b_proj's rows (w_uv's L or V contiguous), 1 .. 5, 8 and 17 tokens split
// into prefill runs and decode tokens of a few sequences, head counts that fill one tile, split into
// several or leave a partial one, latent widths with and without a partial register tile, 1 and 2
// threads, and scores spread far enough for exp's clamp; the error returns too.
#include "check.h"

typedef int (*Latent)(const float* q_nope, int64_t nope_t, int64_t nope_h, const float* q_rope, int64_t rope_t,
                      int64_t rope_h, int64_t t, int64_t heads, int64_t nope, int64_t latent, int64_t rope, int64_t v,
                      const float* w_uk, int64_t uk_h, int64_t uk_n, const float* w_uv, int64_t uv_h, int64_t uv_l,
                      int64_t uv_v, const void* latent_cache, const void* rope_cache, int64_t block_size,
                      const int64_t* positions, const int64_t* seq_of_token, const int64_t* tables,
                      int64_t table_width, float scale, float* out, int threads);

namespace {

struct Shape { int64_t heads, N, L, R, V; };

struct Batch {
  int64_t t = 0, sequences = 0, block_size = 0, table_width = 0, blocks = 0;
  std::vector<int64_t> positions, seq_of_token, tables;
};

// t tokens of up to three sequences: runs of consecutive positions (prefill chunks) ending at a random
// context length, some runs of one (decode tokens); a sequence may come back later in the batch.
Batch make_batch(check::Rng& rng, int64_t t, int64_t block_size) {
  Batch b;
  b.t = t;
  b.block_size = block_size;
  b.sequences = 1 + rng.below(3);
  const int64_t max_context = 70;
  b.table_width = (max_context + block_size - 1) / block_size;
  b.blocks = b.sequences * b.table_width + 3;
  // Every sequence's blocks, scattered over the pool (a permutation of its ids).
  std::vector<int64_t> ids(b.blocks);
  for (int64_t i = 0; i < b.blocks; ++i) ids[i] = i;
  for (int64_t i = b.blocks - 1; i > 0; --i) std::swap(ids[i], ids[rng.below(i + 1)]);
  b.tables.assign(ids.begin(), ids.begin() + b.sequences * b.table_width);
  std::vector<int64_t> next(b.sequences);  // each sequence's next position
  for (int64_t s = 0; s < b.sequences; ++s) next[s] = rng.below(max_context / 2);
  for (int64_t i = 0; i < t;) {
    const int64_t s = rng.below(b.sequences);
    int64_t run = rng.below(3) == 0 ? 1 : 1 + rng.below(t - i);
    run = std::min(run, max_context - next[s]);
    if (run <= 0) continue;
    for (int64_t k = 0; k < run; ++k, ++i) {
      b.seq_of_token.push_back(s);
      b.positions.push_back(next[s]++);
    }
  }
  return b;
}

template <class T>
void fill_cache(check::Rng& rng, std::vector<T>& c, float scale);
template <>
void fill_cache(check::Rng& rng, std::vector<float>& c, float scale) { rng.fill(c, scale); }
template <>
void fill_cache(check::Rng& rng, std::vector<uint16_t>& c, float scale) {
  for (uint16_t& x : c) x = check::half_of(rng.normal(scale));
}

// One call of both builds; compares the return codes and every output.
template <class T>
void compare(const char* suffix, const check::Lib& ref, const check::Lib& cand, check::Report& report,
             check::Rng& rng, const Shape& sh, const Batch& b, bool kv_b_view, float scale, float q_scale,
             int threads, const char* what) {
  const int64_t H = sh.heads, N = sh.N, L = sh.L, R = sh.R, V = sh.V, t = b.t;
  // q [T, H, N + R]: q_nope and q_rope views of it, as the model splits q_proj's output.
  std::vector<float> q(t * H * (N + R));
  rng.fill(q, q_scale);
  // kv_b_proj's weight [H * (N + V), L]: w_uk [H, N, L] and w_uv [H, L, V] as views of it (uv_l == 1), or copies.
  std::vector<float> kv_b(H * (N + V) * L);
  rng.fill(kv_b, 0.2f);
  std::vector<float> w_uk_copy(H * N * L), w_uv_copy(H * L * V);
  for (int64_t h = 0; h < H; ++h) {
    for (int64_t n = 0; n < N; ++n)
      for (int64_t l = 0; l < L; ++l) w_uk_copy[(h * N + n) * L + l] = kv_b[(h * (N + V) + n) * L + l];
    for (int64_t l = 0; l < L; ++l)
      for (int64_t v = 0; v < V; ++v) w_uv_copy[(h * L + l) * V + v] = kv_b[(h * (N + V) + N + v) * L + l];
  }
  const float* w_uk = kv_b_view ? kv_b.data() : w_uk_copy.data();
  const int64_t uk_h = kv_b_view ? (N + V) * L : N * L, uk_n = L;
  const float* w_uv = kv_b_view ? kv_b.data() + N * L : w_uv_copy.data();
  const int64_t uv_h = kv_b_view ? (N + V) * L : L * V, uv_l = kv_b_view ? 1 : V, uv_v = kv_b_view ? L : 1;
  std::vector<T> lat(b.blocks * b.block_size * L), rope(b.blocks * b.block_size * R);
  fill_cache(rng, lat, 1.0f);
  fill_cache(rng, rope, 1.0f);
  std::vector<float> o1(t * H * V, -7.0f), o2(t * H * V, -7.0f);
  const Latent f = ref.fn<Latent>(suffix), g = cand.fn<Latent>(suffix);
  const int64_t qt = H * (N + R), qh = N + R;
  const int r1 = f(q.data(), qt, qh, q.data() + N, qt, qh, t, H, N, L, R, V, w_uk, uk_h, uk_n, w_uv, uv_h, uv_l, uv_v,
                   lat.data(), rope.data(), b.block_size, b.positions.data(), b.seq_of_token.data(), b.tables.data(),
                   b.table_width, scale, o1.data(), threads);
  const int r2 = g(q.data(), qt, qh, q.data() + N, qt, qh, t, H, N, L, R, V, w_uk, uk_h, uk_n, w_uv, uv_h, uv_l, uv_v,
                   lat.data(), rope.data(), b.block_size, b.positions.data(), b.seq_of_token.data(), b.tables.data(),
                   b.table_width, scale, o2.data(), threads);
  if (r1 != 0 || r2 != 0) {
    fprintf(stderr, "%s: returned %d and %d, not 0\n", what, r1, r2);
    ++report.failures;
    return;
  }
  report.same(what, o1, o2);
}

// The refusals: a latent width not in 16s (-1), w_uv with neither of its last two dimensions contiguous (-2).
void check_errors(const check::Lib& ref, const check::Lib& cand, check::Report& report) {
  float q[64] = {0}, w[64] = {0}, lat[64] = {0}, out[64];
  int64_t pos = 0, seq = 0, table = 0;
  for (int k = 0; k < 2; ++k) {
    const char* name = k ? "tm_latent_attention_f16" : "tm_latent_attention";
    const Latent fs[2] = {ref.fn<Latent>(name), cand.fn<Latent>(name)};
    for (const Latent f : fs) {
      const int bad_width = f(q, 32, 32, q, 32, 32, 1, 1, 16, 20, 16, 16, w, 0, 0, w, 0, 16, 1, lat, lat, 1, &pos,
                              &seq, &table, 1, 1.0f, out, 1);
      const int bad_uv = f(q, 32, 32, q, 32, 32, 1, 1, 16, 16, 16, 16, w, 0, 0, w, 0, 2, 3, lat, lat, 1, &pos, &seq,
                           &table, 1, 1.0f, out, 1);
      ++report.checks;
      if (bad_width != -1 || bad_uv != -2) {
        fprintf(stderr, "%s: returned %d and %d for the refusals, not -1 and -2\n", name, bad_width, bad_uv);
        ++report.failures;
      }
    }
  }
}

}  // namespace

CHECK_MAIN("latent_attention")
void run(const check::Lib& ref, const check::Lib& cand, check::Report& report) {
  check::Rng rng(23);
  // heads: one, a partial head chunk (8 heads a tile), two chunks, a partial third; L = 80 and 48 leave a
  // partial register tile of the latent.
  const Shape shapes[] = {{1, 16, 32, 16, 16}, {3, 24, 64, 16, 32}, {8, 32, 80, 32, 48}, {16, 16, 128, 64, 16},
                          {20, 8, 48, 16, 64}};
  const int64_t rows[] = {1, 2, 3, 4, 5, 8, 17};
  char what[160];
  int variant = 0;
  for (const Shape& sh : shapes) {
    for (int64_t t : rows) {
      for (int threads = 1; threads <= 2; ++threads, ++variant) {
        const int64_t block_size = variant % 3 == 0 ? 16 : variant % 3 == 1 ? 4 : 1;
        const Batch b = make_batch(rng, t, block_size);
        const bool kv_b_view = variant % 2 == 1;
        // Every fourth call: queries large enough that the scores spread over thousands (exp's clamp at -87).
        const bool wild = variant % 5 == 4;
        const float scale = 1.0f / sqrtf((float)(sh.N + sh.R)), q_scale = wild ? 60.0f : 1.0f;
        for (int f16 = 0; f16 < 2; ++f16) {
          snprintf(what, sizeof what,
                   "latent_attention%s (heads %lld, nope %lld, latent %lld, rope %lld, v %lld, t %lld, threads %d, "
                   "block %lld, %s, %s)",
                   f16 ? "_f16" : "", (long long)sh.heads, (long long)sh.N, (long long)sh.L, (long long)sh.R,
                   (long long)sh.V, (long long)t, threads, (long long)block_size, kv_b_view ? "kv_b view" : "copies",
                   wild ? "wild scores" : "plain scores");
          if (f16)
            compare<uint16_t>("tm_latent_attention_f16", ref, cand, report, rng, sh, b, kv_b_view, scale, q_scale,
                              threads, what);
          else
            compare<float>("tm_latent_attention", ref, cand, report, rng, sh, b, kv_b_view, scale, q_scale, threads,
                           what);
        }
      }
    }
  }
  check_errors(ref, cand, report);
}
