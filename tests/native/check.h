// The harness of the bit-for-bit checks: a check program loads two builds of one kernel library (the
// scalar definition and one instruction set's build), calls both with the same inputs and compares every
// output bit for bit. Plain C++ and dlopen, so the same program runs natively on x86 and under
// qemu-aarch64 for the ARM64 builds (make test-arm).
//
//   check_<kernel> REFERENCE.so CANDIDATE.so    exit 0: every output the same; 1: a difference (printed)
#pragma once

#include <dlfcn.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <vector>

namespace check {

struct Lib {
  void* handle = nullptr;
  const char* path = "";
  template <class F>
  F fn(const char* name) const {
    void* p = dlsym(handle, name);
    if (!p) {
      fprintf(stderr, "%s: no symbol %s\n", path, name);
      exit(2);
    }
    return reinterpret_cast<F>(p);
  }
};

inline Lib open(const char* path) {
  Lib lib;
  lib.path = path;
  lib.handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!lib.handle) {
    fprintf(stderr, "cannot load %s: %s\n", path, dlerror());
    exit(2);
  }
  return lib;
}

// A fixed stream of pseudo-random numbers (splitmix64): the same inputs on every machine.
struct Rng {
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed) {}
  uint64_t next() {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  float uniform(float lo = -1.0f, float hi = 1.0f) { return lo + (hi - lo) * (float)(next() >> 40) * (1.0f / 16777216.0f); }
  // A normal variate's rough stand-in (sum of uniforms), scaled.
  float normal(float scale = 1.0f) {
    float t = 0;
    for (int i = 0; i < 4; ++i) t += uniform();
    return t * 0.866f * scale;
  }
  int64_t below(int64_t n) { return (int64_t)(next() % (uint64_t)n); }
  void fill(std::vector<float>& v, float scale = 1.0f) { for (float& x : v) x = normal(scale); }
  void fill_bytes(std::vector<uint8_t>& v) { for (uint8_t& x : v) x = (uint8_t)next(); }
};

// float16 bits of a float in range (for building inputs: the kernels' own conversions are what is checked).
inline uint16_t half_of(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  const uint32_t sign = (u >> 16) & 0x8000, abs = u & 0x7FFFFFFF;
  if (abs < 0x38800000) return (uint16_t)sign;  // below float16's normals: 0 (inputs only)
  if (abs >= 0x477FE000) return (uint16_t)(sign | 0x7BFF);
  return (uint16_t)(sign | ((abs - 0x38000000 + 0x1000) >> 13));
}

struct Report {
  int failures = 0;
  int checks = 0;
  // Compares n bytes; prints the first differing element (as float32 when elem is 4).
  bool same(const char* what, const void* a, const void* b, size_t bytes, size_t elem = 4) {
    ++checks;
    if (memcmp(a, b, bytes) == 0) return true;
    ++failures;
    const uint8_t* pa = (const uint8_t*)a;
    const uint8_t* pb = (const uint8_t*)b;
    size_t i = 0;
    while (i < bytes && pa[i] == pb[i]) ++i;
    const size_t at = i / elem;
    if (elem == 4) {
      float fa, fb;
      memcpy(&fa, pa + at * 4, 4);
      memcpy(&fb, pb + at * 4, 4);
      uint32_t ua, ub;
      memcpy(&ua, pa + at * 4, 4);
      memcpy(&ub, pb + at * 4, 4);
      fprintf(stderr, "DIFFERENT %s: element %zu: %.9g (0x%08x) against %.9g (0x%08x)\n", what, at, fa, ua, fb, ub);
    } else {
      fprintf(stderr, "DIFFERENT %s: byte %zu: 0x%02x against 0x%02x\n", what, i, pa[i], pb[i]);
    }
    return false;
  }
  // Floats: the same bits, or NaN on both sides (a NaN's sign and payload depend on the instruction's operand
  // order, which compilers choose, and differ between x86 and ARM: they are no part of the definition).
  bool same_floats(const char* what, const float* a, const float* b, size_t n) {
    for (size_t i = 0; i < n; ++i) {
      uint32_t ua, ub;
      memcpy(&ua, a + i, 4);
      memcpy(&ub, b + i, 4);
      if (ua != ub && !(isnan(a[i]) && isnan(b[i]))) return same(what, a + i, b + i, 4 * (n - i));
    }
    ++checks;
    return true;
  }
  bool same(const char* what, const std::vector<float>& a, const std::vector<float>& b) {
    return same_floats(what, a.data(), b.data(), a.size());
  }
  template <class T>
  bool same(const char* what, const std::vector<T>& a, const std::vector<T>& b) {
    return same(what, a.data(), b.data(), a.size() * sizeof(T), sizeof(T) == 4 ? 4 : 1);
  }
  int finish(const char* name) const {
    printf("%s: %d checks, %d different\n", name, checks, failures);
    return failures ? 1 : 0;
  }
};

}  // namespace check

// The program's body: void run(const check::Lib& ref, const check::Lib& cand, check::Report& report).
#define CHECK_MAIN(name)                                                   \
  void run(const check::Lib& ref, const check::Lib& cand, check::Report& report); \
  int main(int argc, char** argv) {                                        \
    if (argc != 3) {                                                       \
      fprintf(stderr, "usage: %s REFERENCE.so CANDIDATE.so\n", argv[0]);   \
      return 2;                                                            \
    }                                                                      \
    const check::Lib ref = check::open(argv[1]), cand = check::open(argv[2]); \
    check::Report report;                                                  \
    run(ref, cand, report);                                                \
    return report.finish(name);                                            \
  }
