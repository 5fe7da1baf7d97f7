// How fast this machine streams memory into the cores: the yardstick a decode step's weight reads
// are measured against (tokenmill-bench's machine section). A decode step reads each weight once,
// in order, with vector loads on every worker thread; so does this, with no arithmetic to wait
// on (independent sums of each 256-byte line's 64-bit words per thread), over a buffer far larger
// than the caches. torch's or numpy's sum of a float buffer, the other methods the bench reports,
// are bound by their additions on some CPUs and read slower than the memory can deliver.
// Each thread asks for its lines 8 KB ahead into L2, as the products do with their weights
// (vnni_common.h's PREFETCH_AHEAD): on the VMs measured, the hardware prefetchers alone left a
// thread's stream at two thirds of what the products read, and the yardstick must not be slower
// than what it measures. One line a turn of the loop, its prefetch beside its load: on an Intel Xeon
// that read 1.2 times as fast (37.7 GB/s against 30.9) as four lines a turn with their four
// prefetches first, the fastest of the patterns tried there.
// Plain C++: g++ -O3 turns the loop into the instruction set's widest loads and 64-bit adds (one
// zmm accumulator on AVX-512, two ymm on AVX2, four q on NEON). Integer sums, so the checksum is the
// same whatever the order.

#include <omp.h>
#include <stdint.h>

#include "tm_abi.h"  // this file's prototypes (generated from abi.py)

// The buffer's bytes read as 64-bit words (may_alias: whatever type wrote them).
typedef uint64_t __attribute__((may_alias)) word;

static constexpr int64_t AHEAD = 8192;  // bytes; vnni_common.h's PREFETCH_AHEAD

extern "C" {

// The sum of the bytes at p (bytes: a multiple of 256; p 64-byte aligned) as 64-bit lanes, read by
// `threads` threads, each one contiguous share. The sum is returned so that no load can be dropped.
int64_t tm_stream_read(const uint8_t* p, int64_t bytes, int threads) {
  uint64_t total = 0;
  const int64_t lines = bytes / 64;
  const uint8_t* base = (const uint8_t*)__builtin_assume_aligned(p, 64);
#pragma omp parallel num_threads(threads) reduction(+ : total)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t first = lines * t / nt, last = lines * (t + 1) / nt;
    uint64_t s[8] = {0};  // one sum per word of a line
    for (int64_t i = first; i < last; ++i) {
      const word* w = (const word*)(base + i * 64);
      __builtin_prefetch(base + i * 64 + AHEAD, 0, 2);  // past the end: no fault
      for (int j = 0; j < 8; ++j) s[j] += w[j];
    }
    // The lanes hold 64-bit words; their sum (mod 2^64) is a checksum the caller can recompute.
    uint64_t sum = 0;
    for (int j = 0; j < 8; ++j) sum += s[j];
    total += sum;
  }
  return (int64_t)total;
}
}
