// What one decoding row's k-quant products read from memory, against what the machine can read and what a bare
// loop of the same arithmetic reads: a step's worth of Q4_K products of Llama-3.2-1B's shapes (LAYERS layers of
// K = 2048 and N = 3072, 2048, 16384, 8192: 16 of them 536 MB, in 2 MB pages), passed over at one row on all
// threads, called from C++ so that nothing runs between the products. Each pass, in turn:
//   - a plain read of the same bytes (a 64-byte line a turn, its prefetch 8 KB ahead into L2: the read probe's loop);
//   - the kernel library's tm_kquant_gemm, product by product (each library named on the command line);
//   - a bare loop: the one-row Q4_K tile's instructions written out here (the packed layout of kquant_gemm.cpp, the
//     activations as two int8 digits, byte products, the fold of each block, each step's share of the prefetches),
//     each thread calling it for its half of a product's groups, with no driver around it.
// Printed: the medians of the passes, in GB/s and as a share of the plain read (bench/history.md).
//
//   g++ -O2 -march=native -fopenmp bench/kernels/one_row_pass.cpp -o build/one_row_pass -ldl
//   LIB=$(python -c "from tokenmill_service.worker.kernels.cpu import build
//   print(build.built('kquant_gemm', 'avx512'))")
//   build/one_row_pass 30 16 $LIB [another build of the library ...]     # passes, layers, libraries
//
// AVX-512 VNNI only (the bare loop's intrinsics); the libraries are loaded side by side, each packing its own copy
// of the weights, so any two builds of the kernel (bench/kernels/quantized_gemm_speed.py builds a revision's into
// the kernel cache), even of two layouts, can be compared by their pass's time. The plain read and the bare loop
// read the first library's packing: name the working tree's build first.

#include <dlfcn.h>
#include <immintrin.h>
#include <omp.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

constexpr int kQ4K = 12;                                  // ggml's Q4_K
constexpr int64_t kK = 2048, kSuper = 2304, kQuants = 2048;  // a group's super-block: 8 x 256 nibbles, then scales
constexpr int64_t kAhead = 8192;

using PackedBytes = int64_t (*)(int, int64_t, int64_t);
using Pack = int (*)(int, const uint8_t*, int64_t, int64_t, uint8_t*);
using Gemm = int (*)(int, const float*, int64_t, int64_t, const uint8_t*, int64_t, float*, int);

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// The bare loop: 16 outputs of one group of 16 rows (kquant_gemm.cpp's layout and numerics, written out).
__attribute__((noinline)) float bare_group(const uint8_t* w, const int8_t* act, const float* dx, const float* sx) {
  __m512 acc = _mm512_setzero_ps();
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  for (int64_t sb = 0; sb < kK / 256; ++sb) {
    const uint8_t* q = w + sb * kSuper;
    const uint8_t* sc = q + kQuants;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)sc));
    const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(sc + 32)));
    for (int j = 0; j < 8; ++j) {
      const int64_t b = sb * 8 + j;
      const int8_t* a = act + b * 64;  // the block's 32 high digits, then its 32 low ones
      __m512i hi = _mm512_setzero_si512(), lo = _mm512_setzero_si512();
#pragma GCC unroll 4
      for (int s = 0; s < 4; ++s) {
        const int64_t part = 4 * j + s;  // this step's share of the super-block's lines, 8 KB ahead
        const uintptr_t start = (uintptr_t)(q + kAhead), end = start + (part + 1) * kSuper / 32;
        for (uintptr_t line = (start + part * kSuper / 32 + 63) & ~(uintptr_t)63; line < end; line += 64)
          _mm_prefetch((const char*)line, _MM_HINT_T1);
        const __m512i v = _mm512_load_si512(q + j * 256 + s * 64);
        const __m512i w0 = _mm512_and_si512(v, m4), w1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
        int32_t h0, h1, l0, l1;
        memcpy(&h0, a + 8 * s, 4);
        memcpy(&h1, a + 8 * s + 4, 4);
        memcpy(&l0, a + 32 + 8 * s, 4);
        memcpy(&l1, a + 32 + 8 * s + 4, 4);
        hi = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(hi, w0, _mm512_set1_epi32(h0)), w1, _mm512_set1_epi32(h1));
        lo = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(lo, w0, _mm512_set1_epi32(l0)), w1, _mm512_set1_epi32(l1));
      }
      const __m512i sum = _mm512_add_epi32(_mm512_slli_epi32(hi, 8), lo);
      // sc << 2 | (m & 3) a block, then m >> 2 two blocks a byte (kquant_layout.h's six-bit scales)
      const __m512i low = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(sc + 64 + 16 * j)));
      const __m512i high = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(sc + 192 + 16 * (j / 2))));
      const __m512i scj = _mm512_srli_epi32(low, 2);
      const __m512i mj = _mm512_or_si512(_mm512_and_si512(low, _mm512_set1_epi32(3)),
                                         _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(high, 4 * (j % 2)),
                                                                            _mm512_set1_epi32(15)), 2));
      const __m512 de = _mm512_mul_ps(d, _mm512_cvtepi32_ps(scj));
      const __m512 dm = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(mj));
      acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(de, _mm512_set1_ps(dx[b])), acc);
      acc = _mm512_fnmadd_ps(dm, _mm512_set1_ps(sx[b]), acc);
    }
  }
  return _mm512_reduce_add_ps(acc);
}

float bare_product(const uint8_t* w, int64_t n, const int8_t* act, const float* dx, const float* sx) {
  const int64_t groups = n / 16, group_bytes = kK / 256 * kSuper;
  float total = 0;
#pragma omp parallel reduction(+ : total)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    for (int64_t g = groups * t / nt; g < groups * (t + 1) / nt; ++g)
      total += bare_group(w + g * group_bytes, act, dx, sx);
  }
  return total;
}

int64_t plain_read(const uint8_t* buf, int64_t n) {
  int64_t sink = 0;
#pragma omp parallel reduction(+ : sink)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    __m512i seen = _mm512_setzero_si512();
    for (int64_t i = n * t / nt / 64 * 64; i < n * (t + 1) / nt / 64 * 64; i += 64) {
      _mm_prefetch((const char*)buf + i + kAhead, _MM_HINT_T1);
      seen = _mm512_xor_si512(seen, _mm512_load_si512(buf + i));
    }
    sink += _mm512_reduce_add_epi32(seen);
  }
  return sink;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// A library's products, one after another in one mapping of 2 MB pages (as huge_pages.py lays the weights out),
// each packed by that library (two builds may lay a weight out differently).
struct Library {
  Gemm gemm;
  std::vector<std::pair<int64_t, int64_t>> products;  // offset, N
  uint8_t* buf = nullptr;
  int64_t total = 0;

  bool pack(PackedBytes packed_bytes, Pack pack_fn, int layers) {
    const int64_t shapes[] = {3072, 2048, 16384, 8192}, page = 2 << 20;
    for (int layer = 0; layer < layers; ++layer)
      for (const int64_t n : shapes) {
        products.push_back({total, n});
        total += (packed_bytes(kQ4K, n, kK) + 4095) / 4096 * 4096;
      }
    buf = (uint8_t*)std::aligned_alloc(page, (total + kAhead + page - 1) / page * page);
    if (buf == nullptr) return false;
    madvise(buf, total + kAhead, MADV_HUGEPAGE);
    std::memset(buf + total, 0, kAhead);
    for (const auto& [offset, n] : products) {
      std::vector<uint8_t> blocks(n * (kK / 256) * 144);  // random bytes, with d and dmin of a plausible size
      for (size_t i = 0; i < blocks.size(); ++i) blocks[i] = (uint8_t)((i * 2654435761u) >> 13);
      for (int64_t b = 0; b < n * (kK / 256); ++b) {
        const uint16_t d = (uint16_t)(0x2000 + b % 512);
        std::memcpy(&blocks[b * 144], &d, 2);
        std::memcpy(&blocks[b * 144 + 2], &d, 2);
      }
      if (pack_fn(kQ4K, blocks.data(), n, kK, buf + offset) != 0) return false;
    }
    return true;
  }
};

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: %s PASSES LAYERS LIBRARY [LIBRARY ...]\n", argv[0]);
    return 2;
  }
  const int passes = std::atoi(argv[1]), layers = std::atoi(argv[2]), libs = argc - 3, threads = omp_get_max_threads();
  std::vector<Library> all;
  for (int l = 0; l < libs; ++l) {
    void* lib = dlopen(argv[3 + l], RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      std::fprintf(stderr, "%s\n", dlerror());
      return 1;
    }
    Library one{(Gemm)dlsym(lib, "tm_kquant_gemm")};
    if (!one.pack((PackedBytes)dlsym(lib, "tm_kquant_packed_bytes"), (Pack)dlsym(lib, "tm_kquant_pack"), layers))
      return 1;
    all.push_back(one);
  }
  const Library& first = all[0];  // the plain read and the bare loop read its bytes
  std::vector<float> x(kK), y(16384), dx(kK / 32, 0.01f), sx(kK / 32, 0.02f);
  std::vector<int8_t> act(2 * kK);
  for (int64_t i = 0; i < kK; ++i) x[i] = (float)((i * 37) % 101 - 50) / 50.f;
  for (int64_t i = 0; i < 2 * kK; ++i) act[i] = (int8_t)(i % 97);
  std::vector<double> probe, bare;
  std::vector<std::vector<double>> lib_seconds(libs);
  volatile float sink = 0;
  for (int p = 0; p < passes; ++p) {
    double t0 = now();
    sink = sink + (float)plain_read(first.buf, first.total);
    probe.push_back(first.total / (now() - t0) / 1e9);
    for (int l = 0; l < libs; ++l) {
      const int which = p % 2 ? libs - 1 - l : l;  // alternately first and last
      const Library& lib = all[which];
      t0 = now();
      for (const auto& [offset, n] : lib.products)
        lib.gemm(kQ4K, x.data(), 1, kK, lib.buf + offset, n, y.data(), threads);
      lib_seconds[which].push_back(now() - t0);
    }
    t0 = now();
    float s = 0;
    for (const auto& [offset, n] : first.products)
      s += bare_product(first.buf + offset, n, act.data(), dx.data(), sx.data());
    bare.push_back(first.total / (now() - t0) / 1e9);
    sink = sink + s;
  }
  const double read = median(probe);
  std::printf("%lld MB a pass (the first library's packing), %d threads, medians of %d passes\n",
              (long long)(first.total >> 20), threads, passes);
  std::printf("  %-60s %6.1f GB/s\n", "plain read", read);
  for (int l = 0; l < libs; ++l) {  // each library's rate of its own bytes, and its pass's time
    const double seconds = median(lib_seconds[l]), rate = all[l].total / seconds / 1e9;
    std::printf("  %-60s %6.1f GB/s (%3.0f %%) %7.2f ms, %lld MB\n", argv[3 + l], rate, 100 * rate / read,
                1e3 * seconds, (long long)(all[l].total >> 20));
  }
  std::printf("  %-60s %6.1f GB/s (%3.0f %%)\n", "bare loop", median(bare), 100 * median(bare) / read);
  return 0;
}
