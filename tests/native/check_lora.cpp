// lora.cpp, two builds bit for bit: tm_lora_add with float32 and bfloat16 adapters, one part and a packed
// layer's three, ranks that are and are not multiples of the tiles' (0: a part not targeted), groups of
// 1..5, 8, 17 and 25 rows in shuffled order, input widths of one and several vectors, output columns with
// tails, 1 and 2 threads. Both the outputs (y, added to) and the shrunk values (the scratch) are compared.
#include "check.h"

// abi.py's TmLoraBatch: group g is slot slots[g], its rows rows[offsets[g] .. offsets[g + 1]).
struct TmLoraBatch {
  int64_t groups;
  const int64_t* slots;
  const int64_t* offsets;
  const int64_t* rows;
};

typedef int (*LoraAdd)(int dtype, const float* x, int64_t in, const TmLoraBatch* batch, const uint8_t* a,
                       const uint8_t* bt, const int64_t* ranks, int64_t max_rank, int64_t parts,
                       const int64_t* part_rows, int64_t out, float* y, float* scratch, int threads);

namespace {

constexpr int FLOAT32 = 0, BFLOAT16 = 1;  // abi.py's LORA_DTYPES

// n weights of dtype as bytes: float32, or bfloat16 (a float's upper half).
std::vector<uint8_t> weights(int dtype, int64_t n, float scale, check::Rng& rng) {
  std::vector<uint8_t> w(n * (dtype == FLOAT32 ? 4 : 2));
  for (int64_t i = 0; i < n; ++i) {
    const float v = rng.normal(scale);
    if (dtype == FLOAT32) {
      memcpy(w.data() + 4 * i, &v, 4);
    } else {
      uint32_t u;
      memcpy(&u, &v, 4);
      const uint16_t h = (uint16_t)(u >> 16);
      memcpy(w.data() + 2 * i, &h, 2);
    }
  }
  return w;
}

struct Layer {
  int64_t in, max_rank, out;
  std::vector<int64_t> part_rows;  // (start, count) per part
};

}  // namespace

CHECK_MAIN("lora")
void run(const check::Lib& ref, const check::Lib& cand, check::Report& report) {
  const LoraAdd f1 = ref.fn<LoraAdd>("tm_lora_add"), f2 = cand.fn<LoraAdd>("tm_lora_add");
  check::Rng rng(5);
  const int64_t slots = 3;
  // One part (a plain projection); a packed q/k/v's three parts of unequal widths, not covering every column.
  const Layer layers[] = {
      {16, 5, 37, {0, 37}},
      {48, 16, 130, {0, 64, 64, 20, 90, 33}},
      {208, 7, 100, {3, 17, 20, 80}},
  };
  // Each case: the row counts of the step's groups.
  const std::vector<int64_t> groupings[] = {{1}, {2, 3}, {4, 5, 8}, {17, 1, 25}};
  char what[160];
  for (int dtype : {FLOAT32, BFLOAT16}) {
    for (const Layer& L : layers) {
      const int64_t parts = (int64_t)L.part_rows.size() / 2, R = L.max_rank;
      const std::vector<uint8_t> a = weights(dtype, slots * parts * R * L.in, 0.3f, rng);
      const std::vector<uint8_t> bt = weights(dtype, slots * R * L.out, 0.2f, rng);
      // Ranks: the whole max_rank, ones that are not multiples of the tiles', 0 (not targeted).
      std::vector<int64_t> ranks(slots * parts);
      for (int64_t s = 0; s < slots; ++s)
        for (int64_t p = 0; p < parts; ++p) {
          const int64_t choice = rng.below(4);
          ranks[s * parts + p] = choice == 0 ? R : choice == 1 ? 1 + rng.below(R) : choice == 2 ? (R > 3 ? 3 : R) : 0;
        }
      ranks[0] = R;  // slot 0's first part: the whole rank
      for (const auto& grouping : groupings) {
        int64_t t = 0;
        for (int64_t n : grouping) t += n;
        t += 2;  // two rows on the base (in no group): left as they are
        std::vector<int64_t> order(t);
        for (int64_t i = 0; i < t; ++i) order[i] = i;
        for (int64_t i = t - 1; i > 0; --i) std::swap(order[i], order[rng.below(i + 1)]);
        std::vector<int64_t> group_slots, offsets{0};
        for (size_t g = 0; g < grouping.size(); ++g) {
          group_slots.push_back((int64_t)g % slots);
          offsets.push_back(offsets.back() + grouping[g]);
        }
        const TmLoraBatch batch{(int64_t)grouping.size(), group_slots.data(), offsets.data(), order.data()};
        std::vector<float> x(t * L.in);
        rng.fill(x);
        std::vector<float> y0(t * L.out);
        rng.fill(y0);
        for (int threads : {1, 2}) {
          std::vector<float> y1 = y0, y2 = y0;
          std::vector<float> s1(t * parts * R, -1.0f), s2(t * parts * R, -1.0f);
          const int r1 = f1(dtype, x.data(), L.in, &batch, a.data(), bt.data(), ranks.data(), R, parts,
                            L.part_rows.data(), L.out, y1.data(), s1.data(), threads);
          const int r2 = f2(dtype, x.data(), L.in, &batch, a.data(), bt.data(), ranks.data(), R, parts,
                            L.part_rows.data(), L.out, y2.data(), s2.data(), threads);
          snprintf(what, sizeof what, "%s in=%lld rank=%lld parts=%lld rows=%lld threads=%d",
                   dtype == FLOAT32 ? "float32" : "bfloat16", (long long)L.in, (long long)R, (long long)parts,
                   (long long)t, threads);
          if (r1 != 0 || r2 != 0) {
            fprintf(stderr, "%s: returned %d and %d\n", what, r1, r2);
            ++report.failures;
          }
          char label[200];
          snprintf(label, sizeof label, "%s: y", what);
          report.same(label, y1, y2);
          snprintf(label, sizeof label, "%s: shrunk", what);
          report.same(label, s1, s2);
          ++report.checks;
          if (y1 == y0) {  // the adapters must have added something
            fprintf(stderr, "%s: y unchanged\n", what);
            ++report.failures;
          }
        }
      }
    }
  }
  // The refusals: `in` not a multiple of 16, an unknown dtype.
  const int64_t slot = 0, offsets[2] = {0, 1}, rows = 0, rank = 1, part_rows[2] = {0, 16};
  const TmLoraBatch one{1, &slot, offsets, &rows};
  std::vector<float> x(32), y(16), scratch(1);
  std::vector<uint8_t> w(4 * 32);
  const int codes[4] = {
      f1(FLOAT32, x.data(), 24, &one, w.data(), w.data(), &rank, 1, 1, part_rows, 16, y.data(), scratch.data(), 1),
      f2(FLOAT32, x.data(), 24, &one, w.data(), w.data(), &rank, 1, 1, part_rows, 16, y.data(), scratch.data(), 1),
      f1(7, x.data(), 16, &one, w.data(), w.data(), &rank, 1, 1, part_rows, 16, y.data(), scratch.data(), 1),
      f2(7, x.data(), 16, &one, w.data(), w.data(), &rank, 1, 1, part_rows, 16, y.data(), scratch.data(), 1)};
  ++report.checks;
  if (codes[0] != -2 || codes[1] != -2 || codes[2] != -1 || codes[3] != -1) {
    fprintf(stderr, "refusals: %d %d %d %d (want -2 -2 -1 -1)\n", codes[0], codes[1], codes[2], codes[3]);
    ++report.failures;
  }
}
