// The arithmetic ceiling of one core: multiply-adds a second of the product instructions a kernel here
// can use, each in 24 independent chains held in registers (enough to hide their latency), on one
// thread. What bench/RESULTS.md's "arithmetic ceiling" quotes. AVX2's always (the avx2 kernels' float
// FMA, their byte products vpmaddubsw + vpaddw, and the 16-bit vpmaddwd + vpaddd); AVX-512's where the
// compiler targets it (-march=native on such a CPU).
//
//   g++ -O2 -march=native bench/kernels/cpu_peak.cpp -o /tmp/cpu_peak && /tmp/cpu_peak
//
// Run it on an otherwise idle machine; start one per core at once for the whole machine's rate.

#include <immintrin.h>

#include <chrono>
#include <cstdio>

namespace {

double seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

constexpr long kSteps = 20000000;

// The eight lanes' sum, for the checksums.
double sum8(__m256 v) {
  float t[8];
  _mm256_storeu_ps(t, v);
  return double(t[0]) + t[1] + t[2] + t[3] + t[4] + t[5] + t[6] + t[7];
}
double sum8(__m256i v) {
  int t[8];
  _mm256_storeu_si256((__m256i*)t, v);
  return double(t[0]) + t[1] + t[2] + t[3] + t[4] + t[5] + t[6] + t[7];
}
constexpr double kInstructions = kSteps * 24.0;

}  // namespace

// Spelled out (not an array in a loop) so that the compiler keeps every chain in a register.
#define EACH12(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
#define DECLARE(i) V c##i = init(i);
#define STEP(i) c##i = OP(c##i);
#define LIVE(i) asm volatile("" : "+v"(c##i));
#define SUM(i) sum += total(c##i);
// Times kSteps rounds of 24 instructions (two on each of 12 chains); prints multiply-adds a second.
#define MEASURE(name, lanes)                            \
  {                                                     \
    EACH12(DECLARE)                                     \
    const double start = seconds();                     \
    for (long n = 0; n < kSteps; ++n) {                 \
      EACH12(STEP) EACH12(STEP) EACH12(LIVE)            \
    }                                                   \
    const double t = seconds() - start;                 \
    double sum = 0;                                     \
    EACH12(SUM)                                         \
    std::printf("%-20s %6.1f G multiply-adds/s (%d a instruction; checksum %g)\n", name, \
                kInstructions * (lanes) / t / 1e9, lanes, sum);                         \
  }

int main() {
  {
    using V = __m256;
    auto init = [](int i) { return _mm256_set1_ps(0.01f * i); };
    auto total = [](V v) { return sum8(v); };
    const V a = _mm256_set1_ps(0.999f), b = _mm256_set1_ps(1e-4f);
#define OP(x) _mm256_fmadd_ps(a, x, b)
    MEASURE("float32 vfmadd231ps-ymm", 8)
#undef OP
  }
  {
    // A byte product as AVX2 takes it (no byte dot product): 32 byte pairs a vpmaddubsw, its pair sums added as
    // words (the kernels keep them in 16 bits and widen them once for several products, left out here): two
    // instructions for 32 multiply-adds, counted as one step. The chain's own value is an operand of the
    // product: with two constants the compiler took the product out of the loop (and this printed 8 times the
    // rate).
    using V = __m256i;
    auto init = [](int i) { return _mm256_set1_epi32(i); };
    auto total = [](V v) { return sum8(v); };
    const V s = _mm256_set1_epi8(5);
#define OP(x) _mm256_add_epi16(x, _mm256_maddubs_epi16(x, s))
    MEASURE("int8 vpmaddubsw-ymm", 32)
#undef OP
  }
  {
    using V = __m256i;
    auto init = [](int i) { return _mm256_set1_epi32(i); };
    auto total = [](V v) { return sum8(v); };
    // The avx2 kernels' int16 product (activations as words): vpmaddwd and the dwords added, 16 a step.
    const V a = _mm256_set1_epi16(5);
#define OP(x) _mm256_add_epi32(x, _mm256_madd_epi16(x, a))
    MEASURE("int16 vpmaddwd-ymm", 16)
#undef OP
  }
#if defined(__AVXVNNI__)
  {
    // AVX-VNNI (the avx2vnni kernels): AVX-512 VNNI's byte and word products on 256-bit registers.
    using V = __m256i;
    auto init = [](int i) { return _mm256_set1_epi32(i); };
    auto total = [](V v) { return sum8(v); };
    const V u = _mm256_set1_epi8(3), s = _mm256_set1_epi8(5), a = _mm256_set1_epi16(3), b = _mm256_set1_epi16(5);
#define OP(x) _mm256_dpbusd_avx_epi32(x, u, s)
    MEASURE("int8 vpdpbusd-ymm", 32)
#undef OP
#define OP(x) _mm256_dpwssd_avx_epi32(x, a, b)
    MEASURE("int16 vpdpwssd-ymm", 16)
#undef OP
  }
#endif
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BF16__)
  {
    using V = __m512;
    auto init = [](int i) { return _mm512_set1_ps(0.01f * i); };
    auto total = [](V v) { return double(_mm512_reduce_add_ps(v)); };
    const V a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(1e-4f);
#define OP(x) _mm512_fmadd_ps(a, x, b)
    MEASURE("float32 vfmadd231ps", 16)
#undef OP
  }
  {
    using V = __m512i;
    auto init = [](int i) { return _mm512_set1_epi32(i); };
    auto total = [](V v) { return double(_mm512_reduce_add_epi32(v)); };
    const V u = _mm512_set1_epi8(3), s = _mm512_set1_epi8(5);
#define OP(x) _mm512_dpbusd_epi32(x, u, s)
    MEASURE("int8 vpdpbusd", 64)
#undef OP
  }
  {
    // The AVX-512 kernels' int16 product (activations as words): 32 pairs of words a vpdpwssd.
    using V = __m512i;
    auto init = [](int i) { return _mm512_set1_epi32(i); };
    auto total = [](V v) { return double(_mm512_reduce_add_epi32(v)); };
    const V a = _mm512_set1_epi16(3), b = _mm512_set1_epi16(5);
#define OP(x) _mm512_dpwssd_epi32(x, a, b)
    MEASURE("int16 vpdpwssd", 32)
#undef OP
  }
  {
    using V = __m512;
    auto init = [](int i) { return _mm512_set1_ps(float(i)); };
    auto total = [](V v) { return double(_mm512_reduce_add_ps(v)); };
    const __m512bh p = (__m512bh)_mm512_set1_epi16(0x3f80), q = (__m512bh)_mm512_set1_epi16(0x3f00);
#define OP(x) _mm512_dpbf16_ps(x, p, q)
    MEASURE("bf16 vdpbf16ps", 32)
#undef OP
  }
#endif
  return 0;
}
