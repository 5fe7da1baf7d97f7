// Which of a quantized product's other instructions take the product instruction's pipes, on one core:
// the ceiling a tile's instruction mix leaves, below cpu_peak.cpp's. Each round runs 24 product
// instructions (two on each of 12 chains) and, beside them on chains of their own, some of the
// instructions a k-quant tile adds per block of 32 weights: the float fold's multiply and FMAs, the
// converts of integer sums to float, and the unpacking's shifts and masks. A rate that falls with them
// means they share the product's pipes; one that holds means they run beside it.
//
//   mkdir -p build && g++ -O2 -march=native bench/kernels/pipe_sharing.cpp -o build/pipe_sharing && build/pipe_sharing
//
// AVX-512 VNNI's vpdpbusd and vpdpwssd where the compiler targets them (-march=native on such a CPU),
// AVX2's byte product (vpmaddubsw and the vpaddw of its pair sums, counted as one) always. Run it on an otherwise idle machine.

#include <immintrin.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>

namespace {

double seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

long kRounds = 20000000;  // the first argument, if given

}  // namespace

#define EACH12(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
#define EACH6(X) X(0) X(1) X(2) X(3) X(4) X(5)
// Distinct starting values, hidden from the compiler, so that no two chains can be merged.
#define DECLARE(i) VI c##i = SET1I(i + 1); asm volatile("" : "+v"(c##i));
#define DECLARE_F(i) VF f##i = SET1F(1.0f + i); asm volatile("" : "+v"(f##i));
#define DECLARE_S(i) VI s##i = SET1I(71 + i); asm volatile("" : "+v"(s##i));
#define STEP(i) c##i = PRODUCT(c##i);
#define FOLD(i) if ((i) < FMAS) f##i = FMA(f##i);
#define FOLD2(i) if ((i) + 6 < FMAS) f##i = FMA(f##i);
#define UNPACK(i) if ((i) < SHIFTS) s##i = AND(SHR(s##i), x);
#define UNPACK2(i) if ((i) + 6 < SHIFTS) s##i = AND(SHR(s##i), x);
#define CONVERT(i) if ((i) < CONVERTS) f##i = CVT(s##i);
#define LIVE(i) asm volatile("" : "+v"(c##i));
// Each chain's first lane into a volatile sink, so that no chain can be dropped (LIVE keeps all 12 in the loop).
#define KEEP(i) sink += LANE0_I(c##i) + LANE0_I(s##i) + LANE0_F(f##i);

// Product instructions a second (G) with FMAS float FMAs, SHIFTS shift-and-mask pairs and CONVERTS
// int32-to-float converts beside every 24 of them.
#define DEFINE_RUN(name)                                                                  \
  template <int FMAS, int SHIFTS, int CONVERTS>                                           \
  double name() {                                                                         \
    VI w = SET1I(0x01020304), x = SET1I(0x03050709);                                      \
    VF m = SET1F(0.999f);                                                                 \
    asm volatile("" : "+v"(w), "+v"(x), "+v"(m));                                         \
    EACH12(DECLARE) EACH6(DECLARE_F) EACH6(DECLARE_S)                                     \
    const double start = seconds();                                                       \
    for (long n = 0; n < kRounds; ++n) {                                                  \
      asm volatile("" : "+v"(w), "+v"(x));                                                \
      EACH12(STEP) EACH12(STEP) EACH6(FOLD) EACH6(FOLD2) EACH6(UNPACK) EACH6(UNPACK2)     \
      EACH6(CONVERT) EACH12(LIVE)                                                         \
    }                                                                                     \
    const double t = seconds() - start;                                                   \
    volatile double sink = 0;                                                             \
    EACH6(KEEP)                                                                           \
    (void)sink;                                                                           \
    return kRounds * 24.0 / t / 1e9;                                                      \
  }

#define REPORT(run, label)                                                                                   \
  {                                                                                                          \
    const double alone = run<0, 0, 0>();                                                                     \
    std::printf("%s: %.2f G a second alone\n", label, alone);                                               \
    std::printf("  + 3 FMAs a 24       %.2f  + 6: %.2f  + 12: %.2f\n", run<3, 0, 0>() / alone,                \
                run<6, 0, 0>() / alone, run<12, 0, 0>() / alone);                                            \
    std::printf("  + 6 shift+and a 24  %.2f  + 12: %.2f\n", run<0, 6, 0>() / alone, run<0, 12, 0>() / alone); \
    std::printf("  + 3 converts a 24   %.2f  + 6: %.2f\n", run<0, 0, 3>() / alone, run<0, 0, 6>() / alone);  \
  }

namespace avx2 {
using VI = __m256i;
using VF = __m256;
#define SET1I _mm256_set1_epi32
#define SET1F _mm256_set1_ps
// The chain's own value an operand, as in cpu_peak.cpp: with two loop constants the compiler hoists it.
#define PRODUCT(c) _mm256_add_epi16(c, _mm256_maddubs_epi16(c, x))
#define FMA(f) _mm256_fmadd_ps(f, m, m)
#define SHR(s) _mm256_srli_epi16(s, 1)
#define AND _mm256_and_si256
#define CVT _mm256_cvtepi32_ps
#define LANE0_I(v) _mm256_extract_epi32(v, 0)
#define LANE0_F(v) _mm256_cvtss_f32(v)
DEFINE_RUN(maddubs)
#undef PRODUCT
#undef FMA
#undef SHR
#undef AND
#undef CVT
#undef LANE0_I
#undef LANE0_F
#undef SET1I
#undef SET1F
}  // namespace avx2

#ifdef __AVX512VNNI__
namespace avx512 {
using VI = __m512i;
using VF = __m512;
#define SET1I _mm512_set1_epi32
#define SET1F _mm512_set1_ps
#define FMA(f) _mm512_fmadd_ps(f, m, m)
#define SHR(s) _mm512_srli_epi16(s, 1)
#define AND _mm512_and_si512
#define CVT _mm512_cvtepi32_ps
#define LANE0_I(v) _mm512_cvtsi512_si32(v)
#define LANE0_F(v) _mm512_cvtss_f32(v)
#define PRODUCT(c) _mm512_dpbusd_epi32(c, w, x)
DEFINE_RUN(dpbusd)
#undef PRODUCT
#define PRODUCT(c) _mm512_dpwssd_epi32(c, w, x)
DEFINE_RUN(dpwssd)
}  // namespace avx512
#endif

int main(int argc, char** argv) {
  if (argc > 1) kRounds = std::atol(argv[1]);
  REPORT(avx2::maddubs, "vpmaddubsw-ymm (+ vpaddw)")
#ifdef __AVX512VNNI__
  REPORT(avx512::dpbusd, "vpdpbusd")
  REPORT(avx512::dpwssd, "vpdpwssd")
#endif
}
