// The k-quant products' register tiles, the activations' form for each row count, and when a pass unpacks its
// weights and scales ahead: choices of speed only, no output's bits depend on them (kquant_gemm.cpp's tiles).
#pragma once

#include <stdint.h>

#include "simd.h"  // the backend: its registers (VECTOR_REGISTERS) and whether it keeps pair sums (PAIR_SUMS)

namespace {

using namespace simd;

// The register tiles and the activations' form (neither changes an output's bits; measured with
// bench/kernels/kquant_tiles.py and quantized_gemm_speed.py, figures in bench/history.md). AVX-512's 32 registers hold
// one vector each: digits (one group, 4 rows) up to 4 rows, past them words (or int8) in tiles of 8 rows x 2 groups on
// Intel's cores (a Xeon: 1.04-1.17 times 4 x 2's speed; 12 x 2, 16 x 1, 8 x 3 slower; the float sums then live in
// memory) and 6 x 2 on AMD's (Zen 4, 512-bit operations in two halves: 1.08-1.14 times 8 x 2's speed at 8-512 rows in
// int8, words 1.02-1.15; its sums and weights fit the registers): wide_rows. AVX-512's int8 at 5-6 rows: one tile of
// 6 rows x 1 group, one stream of weights a span (from memory, against 8 x 2: a 1B step at 6 streams 0.9-0.95 of the
// time). Elsewhere a vector takes two registers (AVX2's 16) or four (NEON's 32): about 8 vectors fit. AVX2: one row
// as digits, each digit's byte products summed as int16 pairs (simd.h's pairs16, as its int8 tiles'; against words
// on an AMD EPYC, both cores in the cache: Q4_K 0.92-0.94 of the time, Q6_K 1.0-1.01; one core Q5_K, Q3_K, Q2_K
// 0.91-0.93; a 1B step at one stream 0.87-0.97), past it words (a byte product is 3 instructions a register without
// the pairs, dot_s16 2; digits at 2-4 rows 0.94-1.26 times as slow), 6 rows x 1 group (4 x 1 0.93-0.97 times
// as fast, 8 x 1 0.94-0.98, 2-4 x 2 0.6-1.1); its int8 keeps the byte products' sums as int16 pairs (simd.h's
// pairs16) in 4 x 1 tiles (1.03-1.1 times 6 x 1's speed; 3 x 1, 8 x 1 slower, 5 x 1 no faster). NEON (not
// measured): digits for every row count, SDOT one instruction for 4 lanes where dot_s16 takes four, 2 rows a tile.
#ifndef KQUANT_MT  // (a dev script may try other tiles)
#if defined(TM_ISA_AVX2)
#define KQUANT_MT 6
#elif defined(TM_ISA_AVX512)
#define KQUANT_MT 8
#else
#define KQUANT_MT 4
#endif
#define KQUANT_NG (VECTOR_REGISTERS >= 32 ? 2 : 1)
#define KQUANT_MT_DIGITS (VECTOR_REGISTERS >= 32 ? 4 : 2)
#if defined(TM_ISA_AVX512)
#define KQUANT_DIGIT_ROWS 4
#define KQUANT_AMD_ROWS 6
#elif defined(TM_ISA_NEON)
#define KQUANT_DIGIT_ROWS INT64_MAX
#elif defined(TM_ISA_AVX2) && !defined(TM_ISA_AVX2VNNI)
#define KQUANT_DIGIT_ROWS 1
#else
#define KQUANT_DIGIT_ROWS 0
#endif
#endif
#ifndef KQUANT_MT_INT8
#define KQUANT_MT_INT8 (PAIR_SUMS ? 4 : KQUANT_MT)
#endif
#if !defined(KQUANT_MT_INT8_FEW) && defined(TM_ISA_AVX512)
#define KQUANT_MT_INT8_FEW 6
#elif !defined(KQUANT_MT_INT8_FEW)
#define KQUANT_MT_INT8_FEW 0
#endif
constexpr int MT = KQUANT_MT;  // activation rows per register tile (as words)
constexpr int NG = KQUANT_NG;  // groups per register tile
constexpr int MT_INT8 = KQUANT_MT_INT8;  // int8: rows per tile past MAX_DIGIT_ROWS_INT8 (AVX2's pair sums: 4 x 1)
constexpr int MT_INT8_FEW = KQUANT_MT_INT8_FEW;  // int8 up to MAX_FEW_ROWS_INT8 rows: this many x 1 group (0: none)
constexpr int64_t MAX_FEW_ROWS_INT8 = 6;
// Rows a tile past the few (int8) or the digits (words), built as MT: KQUANT_AMD_ROWS on AMD's AVX-512 cores (above).
// Every row count up to MT is built (tile_rows): a choice at run time, on which no output's bits depend.
inline int wide_rows(int built) {
#ifdef KQUANT_AMD_ROWS
  if (built > KQUANT_AMD_ROWS && __builtin_cpu_is("amd")) return KQUANT_AMD_ROWS;  // (cpuid's vendor, read at load)
#endif
  return built;
}
constexpr int MT_DIGITS = KQUANT_MT_DIGITS;  // activation rows per register tile as digits (a few rows: one group a tile)
constexpr int64_t MAX_DIGIT_ROWS = KQUANT_DIGIT_ROWS;  // products of at most this many rows take the digits (see tile)
// Words tiles keep dot_s16's chains in flight: one sum an output from 2 x WORD_CHAINS output vectors, two from
// WORD_CHAINS, else four. vpdpwssd's chain is 4 cycles (2), AVX2's vpaddd 1 (1; measured on an AMD EPYC).
#if defined(TM_ISA_AVX2) && !defined(TM_ISA_AVX2VNNI)
constexpr int WORD_CHAINS = 1;
#else
constexpr int WORD_CHAINS = 2;
#endif
constexpr int64_t MAX_DIGIT_ROWS_INT8 = 4;  // int8: up to this many rows MT_DIGITS x 1 tiles, past it MT x NG
// Digits keep each digit's byte products as int16 pairs too where the backend has them (PAIR_SUMS: AVX2's one row).
#ifndef KQUANT_DIGIT_PAIRS
#define KQUANT_DIGIT_PAIRS 1
#endif
constexpr bool DIGIT_PAIRS = KQUANT_DIGIT_PAIRS;
// From UNPACK_TILES tiles of rows a group (0: never; int8 past MAX_DIGIT_ROWS_INT8 rows, words), the formats whose
// step takes their higher bits from other planes (Q5_K, Q6_K, Q3_K) unpacked once a pass into a thread's buffer,
// which each tile of rows then reads. AVX2 (a step's unpacking 6-9 instructions): on an AMD EPYC (quantized_gemm_speed.py
// --int8, both cores, K = 2048) Q5_K and Q3_K 0.81-0.91 of the time at 16-512 rows, Q6_K 0.88-0.90 at 64-512 and
// 0.98-1.01 at 16; words (kquant_tiles.py) 0.94-1.0; Q4_K's nibbles (1.03-1.22), Q2_K and IQ4_XS (0.97-1.07) no
// faster. AVX-512 (vpternlogd, and 8 rows a tile): no faster (1.0-1.2 at 16-512 rows), so not there. The same
// tiles read the scales unpacked there too (kquant_layout.h's scales_ahead: Q4_K's 8-bit products 0.87-0.96 of
// the time; AVX-512's 0.98-1.02).
#if !defined(KQUANT_UNPACK_TILES) && defined(TM_ISA_AVX2)
#define KQUANT_UNPACK_TILES 3
#elif !defined(KQUANT_UNPACK_TILES)
#define KQUANT_UNPACK_TILES 0
#endif
constexpr int64_t UNPACK_TILES = KQUANT_UNPACK_TILES;

}  // namespace
