// How fast this machine streams memory into the cores: the yardstick a decode step's weight reads
// are measured against (tokenmill-bench's machine section). A decode step reads each weight once,
// in order, with AVX-512 loads on every worker thread; so does this, with no arithmetic to wait
// on (four independent sums of 64-byte loads per thread), over a buffer far larger than the caches.
// torch's or numpy's sum of a float buffer, the other methods the bench reports, are bound by
// their additions on some CPUs and read slower than the memory can deliver.
// Built and loaded by kernels/cpu/build.py (g++ -O3 -march=native -fopenmp).

#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#include "tm_abi.h"  // this file's prototypes (generated from abi.py)

#if !defined(__AVX512F__)
#error "memory_probe needs AVX-512F"
#endif

extern "C" {

// The sum of the bytes at p (bytes: a multiple of 256; p 64-byte aligned) as 64-bit lanes, read by
// `threads` threads, each one contiguous share. The sum is returned so that no load can be dropped.
int64_t tm_stream_read(const uint8_t* p, int64_t bytes, int threads) {
  int64_t total = 0;
  const int64_t lines = bytes / 256;
#pragma omp parallel num_threads(threads) reduction(+ : total)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t first = lines * t / nt, last = lines * (t + 1) / nt;
    __m512i s0 = _mm512_setzero_si512(), s1 = s0, s2 = s0, s3 = s0;
    for (int64_t i = first; i < last; ++i) {
      const uint8_t* q = p + i * 256;
      s0 = _mm512_add_epi64(s0, _mm512_load_si512(q));
      s1 = _mm512_add_epi64(s1, _mm512_load_si512(q + 64));
      s2 = _mm512_add_epi64(s2, _mm512_load_si512(q + 128));
      s3 = _mm512_add_epi64(s3, _mm512_load_si512(q + 192));
    }
    // The lanes hold 64-bit words; their sum (mod 2^64) is a checksum the caller can recompute.
    total += _mm512_reduce_add_epi64(_mm512_add_epi64(_mm512_add_epi64(s0, s1), _mm512_add_epi64(s2, s3)));
  }
  return total;
}
}
