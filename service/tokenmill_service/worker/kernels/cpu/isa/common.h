// What every backend of simd.h has alike, whatever its registers: the lane mask's type and the bit casts,
// which no instruction set does otherwise. Each backend includes it first.
#pragma once

#include <stdint.h>
#include <string.h>

namespace simd {

using lanes = uint16_t;  // bit i: lane i

inline float bits_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
inline uint32_t float_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

// bfloat16 is float32's high half: exact.
inline float bf16_to_float(uint16_t h) { return bits_float((uint32_t)h << 16); }

}  // namespace simd
