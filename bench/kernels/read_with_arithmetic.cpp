// How fast a kernel can stream its weights from memory for how much arithmetic it does a byte: each thread reads
// its half of a buffer larger than the caches once, 64 bytes at a time, asking for the lines 8 KB ahead into L2
// (as the quantized products do, vnni_common.h), and does W nibble products a line (an AND, or a shift and an
// AND, then one byte product: what a decoding tile does with a line of 4-bit weights), in 8 independent chains.
// Printed for each W: the rate with the buffer in L2 (1 MiB, one thread: the arithmetic's own rate a core) and
// from memory (all threads). W = 0 only reads (an XOR a line keeps the loads). Where the arithmetic's own rate
// is near the memory's, the two do not overlap whole: the rate from memory says what share of the plain read rate
// a kernel of that much arithmetic can reach on this machine (bench/history.md).
//
//   g++ -O3 -march=native -fopenmp bench/kernels/read_with_arithmetic.cpp -o /tmp/read_with_arithmetic
//   /tmp/read_with_arithmetic [MiB of the buffer, default 1024] [threads, default 2]
//
// AVX-512 VNNI's vpdpbusd where the compiler targets it, else AVX2's vpmaddubsw (a 32-byte half line each).

#include <immintrin.h>
#include <omp.h>
#include <sys/mman.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace {

constexpr int64_t kAhead = 8192;

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
using vec = __m512i;
constexpr const char* kProduct = "vpdpbusd-zmm";
inline vec load(const uint8_t* p) { return _mm512_load_si512(p); }
inline vec nibbles(vec v, int w) {
  const vec m4 = _mm512_set1_epi8(0x0F);
  return (w & 1) ? _mm512_and_si512(_mm512_srli_epi16(v, 4), m4) : _mm512_and_si512(v, m4);
}
inline vec product(vec acc, vec q) { return _mm512_dpbusd_epi32(acc, q, _mm512_set1_epi32(0x01010101)); }
inline vec xor_(vec a, vec b) { return _mm512_xor_si512(a, b); }
inline vec zero() { return _mm512_setzero_si512(); }
inline int64_t reduce(vec v) {
  int32_t t[16];
  _mm512_storeu_si512(t, v);
  int64_t s = 0;
  for (int32_t x : t) s += x;
  return s;
}
#else
using vec = __m256i;
constexpr const char* kProduct = "vpmaddubsw-ymm";
inline vec load(const uint8_t* p) { return _mm256_load_si256((const __m256i*)p); }
inline vec nibbles(vec v, int w) {
  const vec m4 = _mm256_set1_epi8(0x0F);
  return (w & 1) ? _mm256_and_si256(_mm256_srli_epi16(v, 4), m4) : _mm256_and_si256(v, m4);
}
inline vec product(vec acc, vec q) { return _mm256_add_epi16(acc, _mm256_maddubs_epi16(q, _mm256_set1_epi8(1))); }
inline vec xor_(vec a, vec b) { return _mm256_xor_si256(a, b); }
inline vec zero() { return _mm256_setzero_si256(); }
inline int64_t reduce(vec v) {
  int16_t t[16];
  _mm256_storeu_si256((__m256i*)t, v);
  int64_t s = 0;
  for (int16_t x : t) s += x;
  return s;
}
#endif
constexpr int kPerLine = 64 / sizeof(vec);  // vectors a 64-byte line

// Reads [0, n) on `threads` threads with W products a line; returns a checksum (so nothing is optimized out).
template <int W>
int64_t pass(const uint8_t* buf, int64_t n, int threads) {
  int64_t total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t lo = n * t / nt / 64 * 64, hi = n * (t + 1) / nt / 64 * 64;
    vec acc[8], seen = zero();
    for (vec& a : acc) a = zero();
    for (int64_t i = lo; i < hi; i += 64) {
      _mm_prefetch((const char*)buf + i + kAhead, _MM_HINT_T1);  // past the end: a prefetch does not fault
      for (int h = 0; h < kPerLine; ++h) {
        const vec v = load(buf + i + h * (int)sizeof(vec));
        if constexpr (W == 0) seen = xor_(seen, v);
        for (int w = 0; w < W; ++w) acc[(h * W + w) % 8] = product(acc[(h * W + w) % 8], nibbles(v, w));
      }
    }
    for (const vec& a : acc) total += reduce(a);
    total += reduce(seen);
  }
  return total;
}

double seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Bytes a second of the best of `repeats` passes over n bytes.
template <int W>
double rate(const uint8_t* buf, int64_t n, int threads, int repeats, int64_t* sink) {
  double best = 1e30;
  for (int r = 0; r < repeats; ++r) {
    const double t0 = seconds();
    *sink += pass<W>(buf, n, threads);
    const double dt = seconds() - t0;
    if (dt < best) best = dt;
  }
  return n / best / 1e9;
}

template <int W>
void report(const uint8_t* buf, int64_t n, int threads, int64_t* sink) {
  const double cached = rate<W>(buf, 1 << 20, 1, 200, sink);
  const double memory = rate<W>(buf, n, threads, 5, sink);
  std::printf("W=%-3d in L2 %6.1f GB/s a core   from memory %6.1f GB/s on %d threads\n", W, cached, memory, threads);
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t mib = argc > 1 ? std::atoll(argv[1]) : 1024;
  const int threads = argc > 2 ? std::atoi(argv[2]) : 2;
  const int64_t n = mib << 20, page = 2 << 20;
  // In 2 MB pages, as the server's packed weights lie (huge_pages.py), with room for the prefetches past the end.
  auto* buf = (uint8_t*)std::aligned_alloc(page, (n + kAhead + page - 1) / page * page);
  if (buf == nullptr) return 1;
  madvise(buf, n + kAhead, MADV_HUGEPAGE);
  std::memset(buf, 1, n + kAhead);
  std::printf("a %lld MiB buffer, %d threads, %s\n", (long long)mib, threads, kProduct);
  int64_t sink = 0;
  report<0>(buf, n, threads, &sink);
  report<2>(buf, n, threads, &sink);
  report<4>(buf, n, threads, &sink);
  report<8>(buf, n, threads, &sink);
  report<12>(buf, n, threads, &sink);
  report<16>(buf, n, threads, &sink);
  std::printf("checksum %lld\n", (long long)sink);
  std::free(buf);
  return 0;
}
