// The stochastic-rounding hash of bf16 moments (docs/NUMERICS.md rule 2): the one definition used
// by the host kernels (cpp/src/adamw.cpp, cpp/src/cpu/) and the CUDA kernels (cuda/src/numerics.cuh).
//
// bits(seed, step, index, moment) = finish(index_term(index) + key(seed, step, moment)), a value in
// [0, 65535]; all arithmetic is uint32 modulo 2^32, so the sum may be formed in any order (the
// kernels precompute key() once per call and add index_term() per element).
// Everything here has internal linkage (unnamed namespace): the per-ISA kernel sources include
// it, and an out-of-line copy compiled for AVX-512 must never be picked by the linker for another
// translation unit.
#pragma once
#include <cstdint>

#include "ramstream/hd.h"

namespace ramstream::rounding {
namespace {

constexpr std::uint32_t kIdxLo = 0x9E3779B1u;   // low 32 bits of the element index
constexpr std::uint32_t kIdxHi = 0x85EBCA77u;   // high 32 bits of the element index
constexpr std::uint32_t kSeedLo = 0xC2B2AE3Du;  // low 32 bits of the seed
constexpr std::uint32_t kSeedHi = 0x27D4EB2Fu;  // high 32 bits of the seed
constexpr std::uint32_t kStep = 0x165667B1u;    // low 32 bits of the step
constexpr std::uint32_t kMoment = 0xD3A2646Cu;  // moment: 0 = exp_avg, 1 = exp_avg_sq
constexpr std::uint32_t kMix1 = 0x7FEB352Du;    // finish(): the two multipliers of the mixer
constexpr std::uint32_t kMix2 = 0x846CA68Bu;

// The (seed, step) part of the key.
RAMSTREAM_HD_INLINE std::uint32_t key_base(std::uint64_t seed, std::int64_t step) {
  return static_cast<std::uint32_t>(seed) * kSeedLo + static_cast<std::uint32_t>(seed >> 32) * kSeedHi +
         static_cast<std::uint32_t>(step) * kStep;
}

// The whole key of one moment's stream in one step.
RAMSTREAM_HD_INLINE std::uint32_t key(std::uint64_t seed, std::int64_t step, std::uint32_t moment) {
  return key_base(seed, step) + moment * kMoment;
}

// The element's part: `idx` is the index in the whole state (element index + offset).
RAMSTREAM_HD_INLINE std::uint32_t index_term(std::uint64_t idx) {
  return static_cast<std::uint32_t>(idx) * kIdxLo + static_cast<std::uint32_t>(idx >> 32) * kIdxHi;
}

// The mixer: 16 uniformly distributed bits from the summed key.
RAMSTREAM_HD_INLINE std::uint32_t finish(std::uint32_t k) {
  k ^= k >> 16;
  k *= kMix1;
  k ^= k >> 15;
  k *= kMix2;
  k ^= k >> 16;
  return k & 0xFFFFu;
}

// The 16 random bits of element `idx` of `moment` in the step keyed by `key_base(seed, step)`.
RAMSTREAM_HD_INLINE std::uint32_t bits(std::uint32_t base, std::uint64_t idx, std::uint32_t moment) {
  return finish(index_term(idx) + base + moment * kMoment);
}

}  // namespace
}  // namespace ramstream::rounding
