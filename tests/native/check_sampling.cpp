// sampling.cpp: the log-softmax and softmax of rows of logits (every length's tail, rows masked to -inf,
// flat and peaked rows) and the first index of each row's maximum, scalar build against another.
#include "check.h"

typedef void (*LogSoftmax)(const float*, int64_t, int64_t, int64_t, float*, int);
typedef void (*Softmax)(const float*, int64_t, float*);
typedef void (*Argmax)(const float*, int64_t, int64_t, int64_t, int64_t*);

CHECK_MAIN("sampling")
void run(const check::Lib& ref, const check::Lib& cand, check::Report& report) {
  const LogSoftmax l1 = ref.fn<LogSoftmax>("tm_log_softmax"), l2 = cand.fn<LogSoftmax>("tm_log_softmax");
  const Softmax s1 = ref.fn<Softmax>("tm_softmax"), s2 = cand.fn<Softmax>("tm_softmax");
  const Argmax a1 = ref.fn<Argmax>("tm_argmax_rows"), a2 = cand.fn<Argmax>("tm_argmax_rows");
  check::Rng rng(11);
  const int64_t lengths[] = {1, 7, 16, 17, 100, 1000, 49152, 50001};
  for (int64_t n : lengths) {
    for (float scale : {0.1f, 3.0f, 30.0f}) {
      const int64_t rows = 3;
      std::vector<float> x(rows * (n + 5));
      rng.fill(x, scale);
      for (int64_t i = 0; i < n / 3; ++i) x[rng.below(n)] = -INFINITY;  // a constraint's mask
      std::vector<float> o1(rows * n), o2(rows * n);
      for (int threads : {1, 2}) {
        l1(x.data(), rows, n, n + 5, o1.data(), threads);
        l2(x.data(), rows, n, n + 5, o2.data(), threads);
        report.same("log_softmax", o1, o2);
      }
      std::vector<float> p1(n), p2(n);
      s1(x.data(), n, p1.data());
      s2(x.data(), n, p2.data());
      report.same("softmax", p1, p2);
      x[rows * (n + 5) - 6] = NAN;  // the last row's last entry: its index is -1
      std::vector<int64_t> i1(rows), i2(rows);
      a1(x.data(), rows, n, n + 5, i1.data());
      a2(x.data(), rows, n, n + 5, i2.data());
      report.same("argmax", i1, i2);
    }
  }
}
