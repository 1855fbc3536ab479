// Element conversions (bf16/fp16 <-> float, RNE and stochastic rounding) and the SR hash, in
// scalar, AVX2 and AVX-512 forms. Included only by kernel sources: everything here lives in the
// per-ISA namespace, so no inline function compiled for a wider ISA can leak into another.
#pragma once
#ifndef RAMSTREAM_ISA_NS
#error "adamw_simd.h is for per-ISA kernel sources only"
#endif

#if RAMSTREAM_ISA_LEVEL >= 1
#include <immintrin.h>
#endif
#if defined(__GNUC__) && !defined(__clang__)
// GCC 12 reports its own _mm512_undefined_*() in avx512fintrin.h as "(maybe) uninitialized".
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

#include <cmath>
#include <cstdint>
#include <cstring>

#include "ramstream/rounding.h"

namespace ramstream::cpu::RAMSTREAM_ISA_NS {
namespace {

// ---- scalar forms (the reference every vector form must equal) ----------------------------------

inline std::uint32_t f32_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bits_f32(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float bf16_to_f32(std::uint16_t h) { return bits_f32(static_cast<std::uint32_t>(h) << 16); }

// IEEE half -> float, exact; a signalling NaN comes back quiet (as F16C's vcvtph2ps does).
inline float f16_to_f32(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t e = (h >> 10) & 0x1Fu;
  const std::uint32_t m = h & 0x3FFu;
  if (e == 0x1F) return bits_f32(sign | 0x7F800000u | (m << 13) | (m ? 0x400000u : 0u));
  if (e == 0) {
    // zero or subnormal: m * 2^-24, exact in float
    const float mag = static_cast<float>(m) * 5.9604644775390625e-08f;
    return bits_f32(sign | f32_bits(mag));
  }
  return bits_f32(sign | ((e + 112u) << 23) | (m << 13));
}

// docs/NUMERICS.md rule 1: float -> bf16, round to nearest even; NaN -> 0x7FC0 with the sign kept.
inline std::uint16_t f32_to_bf16_rne(float f) {
  const std::uint32_t u = f32_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<std::uint16_t>(((u >> 16) & 0x8000u) | 0x7FC0u);
  return static_cast<std::uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// float -> IEEE half, round to nearest even, subnormals, overflow to inf; NaN quiet with the
// payload truncated (bit-identical to F16C's vcvtps2ph with _MM_FROUND_TO_NEAREST_INT).
inline std::uint16_t f32_to_f16_rne(float f) {
  const std::uint32_t u = f32_bits(f);
  const std::uint32_t sign = (u >> 16) & 0x8000u;
  const std::uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return static_cast<std::uint16_t>(sign | 0x7E00u | ((a >> 13) & 0x3FFu));
  if (a >= 0x477FF000u) return static_cast<std::uint16_t>(sign | 0x7C00u);  // >= 65520 -> inf
  if (a >= 0x38800000u) {                                                   // normal half
    std::uint32_t r = a - 0x38000000u;                                      // rebias 127 -> 15
    r += 0xFFFu + ((r >> 13) & 1u);
    return static_cast<std::uint16_t>(sign | (r >> 13));
  }
  const std::uint32_t e = a >> 23;
  if (e < 102) return static_cast<std::uint16_t>(sign);  // below 2^-25: rounds to zero
  // subnormal half: (mantissa with hidden bit) * 2^(e-150), in units of 2^-24
  const std::uint32_t m = (a & 0x7FFFFFu) | 0x800000u;
  const std::uint32_t shift = 126u - e;  // 14..24
  std::uint32_t q = m >> shift;
  const std::uint32_t rem = m & ((1u << shift) - 1u);
  const std::uint32_t half = 1u << (shift - 1u);
  if (rem > half || (rem == half && (q & 1u))) ++q;
  return static_cast<std::uint16_t>(sign | q);
}

// docs/NUMERICS.md rule 2: the hash is ramstream/rounding.h; these names are its parts, for the
// vector forms below.
constexpr std::uint32_t kSrIdxLo = rounding::kIdxLo;
constexpr std::uint32_t kSrIdxHi = rounding::kIdxHi;
constexpr std::uint32_t kSrMix1 = rounding::kMix1;
constexpr std::uint32_t kSrMix2 = rounding::kMix2;

inline std::uint32_t sr_index_term(std::uint64_t idx) { return rounding::index_term(idx); }
inline std::uint32_t sr_finish(std::uint32_t k) { return rounding::finish(k); }
// bf16 = (bits + r) >> 16, except inf/NaN: bits >> 16 (NaN kept quiet).
inline std::uint16_t f32_to_bf16_sr(float f, std::uint32_t r) {
  const std::uint32_t u = f32_bits(f);
  if ((u & 0x7F800000u) == 0x7F800000u)
    return static_cast<std::uint16_t>((u >> 16) | ((u & 0x7FFFFFu) ? 0x40u : 0u));
  return static_cast<std::uint16_t>((u + r) >> 16);
}

template <int D>
inline float load1(const void* p, std::int64_t i) {
  if constexpr (D == 0) return static_cast<const float*>(p)[i];
  else if constexpr (D == 1) return bf16_to_f32(static_cast<const std::uint16_t*>(p)[i]);
  else return f16_to_f32(static_cast<const std::uint16_t*>(p)[i]);
}
template <int D>
inline void store1_rne(void* p, std::int64_t i, float x) {
  if constexpr (D == 0) static_cast<float*>(p)[i] = x;
  else if constexpr (D == 1) static_cast<std::uint16_t*>(p)[i] = f32_to_bf16_rne(x);
  else static_cast<std::uint16_t*>(p)[i] = f32_to_f16_rne(x);
}

#if RAMSTREAM_ISA_LEVEL >= 2
// ---- AVX-512: 16 floats -----------------------------------------------------------------------

template <int D>
inline __m512 load16(const void* p, std::int64_t i) {
  if constexpr (D == 0) {
    return _mm512_loadu_ps(static_cast<const float*>(p) + i);
  } else {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const std::uint16_t*>(p) + i));
    if constexpr (D == 1) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    else return _mm512_cvtph_ps(h);
  }
}

// The high 16 bits of each 32-bit lane, packed: one vpermw.
inline __m256i high_halves16(__m512i x) {
  const __m512i idx = _mm512_setr_epi32(0x00030001, 0x00070005, 0x000B0009, 0x000F000D, 0x00130011, 0x00170015,
                                        0x001B0019, 0x001F001D, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_castsi512_si256(_mm512_permutexvar_epi16(idx, x));
}

inline __mmask16 is_nan16(__m512 x) { return _mm512_fpclass_ps_mask(x, 0x81); }  // QNaN | SNaN

inline __m256i f32x16_to_bf16_rne(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb);
  // NaN: sign | 0x7FC0 (in the upper half): (u & 0x80000000) | 0x7FC00000
  const __m512i qnan = _mm512_ternarylogic_epi32(u, _mm512_set1_epi32(static_cast<int>(0x80000000u)),
                                                 _mm512_set1_epi32(0x7FC00000), 0xEA);  // (A & B) | C
  r = _mm512_mask_mov_epi32(r, is_nan16(x), qnan);
  return high_halves16(r);
}

// Random bits for 16 consecutive indices: t = sr_index_term(idx0 + j), uniform high word.
inline __m512i sr_finish16(__m512i k) {
  k = _mm512_xor_si512(k, _mm512_srli_epi32(k, 16));
  k = _mm512_mullo_epi32(k, _mm512_set1_epi32(static_cast<int>(kSrMix1)));
  k = _mm512_xor_si512(k, _mm512_srli_epi32(k, 15));
  k = _mm512_mullo_epi32(k, _mm512_set1_epi32(static_cast<int>(kSrMix2)));
  k = _mm512_xor_si512(k, _mm512_srli_epi32(k, 16));
  return _mm512_and_si512(k, _mm512_set1_epi32(0xFFFF));
}

// Rule 2 with one special case: adding r < 2^16 to inf's bits leaves the upper half alone, so only
// NaN needs care ((bits >> 16) | 0x40 instead of (bits + r) >> 16).
inline __m256i f32x16_to_bf16_sr(__m512 x, __m512i r) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i sum = _mm512_add_epi32(u, r);
  // NaN lanes: (u | 0x00400000) >> 16 == (u >> 16) | 0x40
  return high_halves16(_mm512_mask_or_epi32(sum, is_nan16(x), u, _mm512_set1_epi32(0x00400000)));
}

// ---- AVX-512, two vectors (32 elements) at a time: the pair loop of the AdamW kernel ------------

// 32 bf16 (one 64-byte load) -> two float vectors: each word goes to the high half of its lane and
// the low half is zeroed, one vpermw per vector (no shift).
inline void bf16x32_to_f32(__m512i h, __m512& lo, __m512& hi) {
  const __m512i idx_lo = _mm512_setr_epi32(0x00000000, 0x00010000, 0x00020000, 0x00030000, 0x00040000, 0x00050000,
                                           0x00060000, 0x00070000, 0x00080000, 0x00090000, 0x000A0000, 0x000B0000,
                                           0x000C0000, 0x000D0000, 0x000E0000, 0x000F0000);
  const __m512i idx_hi = _mm512_add_epi32(idx_lo, _mm512_set1_epi32(0x00100000));
  lo = _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(0xAAAAAAAAu, idx_lo, h));
  hi = _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(0xAAAAAAAAu, idx_hi, h));
}

template <int D>
inline void load32(const void* p, std::int64_t i, __m512& lo, __m512& hi) {
  if constexpr (D == 1) {
    bf16x32_to_f32(_mm512_loadu_si512(static_cast<const std::uint16_t*>(p) + i), lo, hi);
  } else {
    lo = load16<D>(p, i);
    hi = load16<D>(p, i + 16);
  }
}

// The high 16 bits of each lane of a (elements 0..15) then b (16..31): one vpermt2w.
inline __m512i high_halves32(__m512i a, __m512i b) {
  const __m512i idx = _mm512_setr_epi32(0x00030001, 0x00070005, 0x000B0009, 0x000F000D, 0x00130011, 0x00170015,
                                        0x001B0019, 0x001F001D, 0x00230021, 0x00270025, 0x002B0029, 0x002F002D,
                                        0x00330031, 0x00370035, 0x003B0039, 0x003F003D);
  return _mm512_permutex2var_epi16(a, idx, b);
}

// Rule 1 without the NaN case: u + 0x7FFF + ((u >> 16) & 1); the bf16 is its high half.
inline __m512i bf16_rne_sum16(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  return _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb);
}

template <int D>
inline void store16_rne(void* p, std::int64_t i, __m512 x, bool stream) {
  if constexpr (D == 0) {
    float* q = static_cast<float*>(p) + i;
    if (stream) _mm512_stream_ps(q, x);
    else _mm512_storeu_ps(q, x);
  } else {
    __m256i h;
    if constexpr (D == 1) h = f32x16_to_bf16_rne(x);
    else h = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256i* q = reinterpret_cast<__m256i*>(static_cast<std::uint16_t*>(p) + i);
    if (stream) _mm256_stream_si256(q, h);
    else _mm256_storeu_si256(q, h);
  }
}
#endif  // RAMSTREAM_ISA_LEVEL >= 2

#if RAMSTREAM_ISA_LEVEL >= 1
// ---- AVX2 + F16C: 8 floats --------------------------------------------------------------------

template <int D>
inline __m256 load8(const void* p, std::int64_t i) {
  if constexpr (D == 0) {
    return _mm256_loadu_ps(static_cast<const float*>(p) + i);
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const std::uint16_t*>(p) + i));
    if constexpr (D == 1) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    else return _mm256_cvtph_ps(h);
  }
}

// The high 16 bits of each 32-bit lane, packed: vpshufb within lanes, then vpermq.
inline __m128i high_halves8(__m256i x) {
  const __m256i pick = _mm256_setr_epi8(2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1,
                                        2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1);
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_shuffle_epi8(x, pick), 0x08));
}

inline __m128i f32x8_to_bf16_rne(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  const __m256i qnan = _mm256_or_si256(_mm256_and_si256(u, _mm256_set1_epi32(static_cast<int>(0x80000000u))),
                                       _mm256_set1_epi32(0x7FC00000));
  return high_halves8(_mm256_blendv_epi8(r, qnan, nan));
}

inline __m256i sr_finish8(__m256i k) {
  k = _mm256_xor_si256(k, _mm256_srli_epi32(k, 16));
  k = _mm256_mullo_epi32(k, _mm256_set1_epi32(static_cast<int>(kSrMix1)));
  k = _mm256_xor_si256(k, _mm256_srli_epi32(k, 15));
  k = _mm256_mullo_epi32(k, _mm256_set1_epi32(static_cast<int>(kSrMix2)));
  k = _mm256_xor_si256(k, _mm256_srli_epi32(k, 16));
  return _mm256_and_si256(k, _mm256_set1_epi32(0xFFFF));
}

// See f32x16_to_bf16_sr.
inline __m128i f32x8_to_bf16_sr(__m256 x, __m256i r) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  const __m256i res = _mm256_blendv_epi8(_mm256_add_epi32(u, r), _mm256_or_si256(u, _mm256_set1_epi32(0x00400000)), nan);
  return high_halves8(res);
}

template <int D>
inline void store8_rne(void* p, std::int64_t i, __m256 x, bool stream) {
  if constexpr (D == 0) {
    float* q = static_cast<float*>(p) + i;
    if (stream) _mm256_stream_ps(q, x);
    else _mm256_storeu_ps(q, x);
  } else {
    __m128i h;
    if constexpr (D == 1) h = f32x8_to_bf16_rne(x);
    else h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m128i* q = reinterpret_cast<__m128i*>(static_cast<std::uint16_t*>(p) + i);
    if (stream) _mm_stream_si128(q, h);
    else _mm_storeu_si128(q, h);
  }
}
#endif  // RAMSTREAM_ISA_LEVEL >= 1

}  // namespace
}  // namespace ramstream::cpu::RAMSTREAM_ISA_NS
