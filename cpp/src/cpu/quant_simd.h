// Element conversions (bf16/fp16 <-> float), the NF4 / int8 code helpers and the vector layer
// (AVX2, AVX-512) of the quantization kernels. Included only by quant_kernels.cpp: everything
// here lives in the per-ISA namespace, so no inline function compiled for a wider ISA can leak
// into another.
#pragma once
#ifndef RAMSTREAM_ISA_NS
#error "quant_simd.h is for per-ISA kernel sources only"
#endif

#include <cstdint>
#include <cstring>

#if RAMSTREAM_ISA_LEVEL > 0
#if defined(__GNUC__) && !defined(__clang__)
// GCC 12's AVX-512 headers self-initialise "undefined" vectors (GCC bug 105593): false positives.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
#endif

#include "ramstream/quant_format.h"

namespace ramstream::cpu::RAMSTREAM_ISA_NS {
namespace {

using std::int64_t;
using std::uint16_t;
using std::uint32_t;
using std::uint8_t;

// ---- scalar element conversions ---------------------------------------------------------------

inline uint32_t f2u(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float u2f(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float bf16_to_f32(uint16_t h) { return u2f(static_cast<uint32_t>(h) << 16); }

// Exact half -> float (as F16C's vcvtph2ps: subnormals kept, NaN quieted with its payload).
inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t mant = h & 0x3FFu;
  if (exp == 0) {  // zero or subnormal: mant * 2^-24, exact in float
    const float v = static_cast<float>(mant) * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  if (exp == 31) return u2f(sign | 0x7F800000u | (mant << 13) | (mant ? 0x00400000u : 0u));
  return u2f(sign | ((exp + 112u) << 23) | (mant << 13));
}

// docs/NUMERICS.md rule 1: round to nearest even; NaN -> sign | 0x7FC0.
inline uint16_t f32_to_bf16(float f) {
  const uint32_t u = f2u(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>(((u >> 16) & 0x8000u) | 0x7FC0u);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// IEEE float -> half, round to nearest even, subnormals, overflow to inf; NaN keeps its sign and
// the top of its payload and is quieted (what F16C's vcvtps2ph does).
inline uint16_t f32_to_f16(float f) {
  const uint32_t u = f2u(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u | ((a >> 13) & 0x3FFu));
  if (a >= 0x47800000u) return static_cast<uint16_t>(sign | 0x7C00u);  // >= 2^16 or inf
  if (a < 0x38800000u) {
    // Below 2^-14: a half subnormal (or zero, or the smallest normal after rounding), whose bits
    // are round(|f| * 2^24). The scaling is exact; adding 2^23 rounds to an integer (RNE).
    const float r = u2f(a) * 16777216.0f + 8388608.0f;
    return static_cast<uint16_t>(sign | (f2u(r) - 0x4B000000u));
  }
  const uint32_t b = a - (112u << 23);  // exponent bias 127 -> 15; rounding may carry to inf
  return static_cast<uint16_t>(sign | ((b + 0xFFFu + ((b >> 13) & 1u)) >> 13));
}

// Element types as tags: load one element as float / store one float.
struct F32 {};
struct BF16 {};
struct F16 {};

template <class T>
float load_s(const void* base, int64_t i);
template <>
inline float load_s<F32>(const void* base, int64_t i) {
  return static_cast<const float*>(base)[i];
}
template <>
inline float load_s<BF16>(const void* base, int64_t i) {
  return bf16_to_f32(static_cast<const uint16_t*>(base)[i]);
}
template <>
inline float load_s<F16>(const void* base, int64_t i) {
  return f16_to_f32(static_cast<const uint16_t*>(base)[i]);
}

template <class T>
void store_s(void* base, int64_t i, float v);
template <>
inline void store_s<F32>(void* base, int64_t i, float v) {
  static_cast<float*>(base)[i] = v;
}
template <>
inline void store_s<BF16>(void* base, int64_t i, float v) {
  static_cast<uint16_t*>(base)[i] = f32_to_bf16(v);
}
template <>
inline void store_s<F16>(void* base, int64_t i, float v) {
  static_cast<uint16_t*>(base)[i] = f32_to_f16(v);
}

// |f| by clearing the sign bit (no libm / std:: inline function in a per-ISA file).
inline float abs_s(float f) { return u2f(f2u(f) & 0x7FFFFFFFu); }

// Round to the nearest integer, ties to even, for |q| < 2^22: adding 1.5 * 2^23 leaves no
// fraction bits (the add rounds to nearest even), subtracting it back is exact.
inline float round_even_s(float q) { return (q + 12582912.0f) - 12582912.0f; }

// max(a, m) that ignores a NaN `a` (the semantics of x86 maxps(a, m)).
inline float max_ignore_nan(float a, float m) { return a > m ? a : m; }

// NaN -> 0, then clamp to [-1, 1].
inline float clamp_unit(float s) {
  s = (s == s) ? s : 0.0f;
  s = s > -1.0f ? s : -1.0f;
  return s < 1.0f ? s : 1.0f;
}

// Number of NF4 midpoints strictly below s.
inline uint32_t nf4_code(float s) {
  uint32_t c = 0;
  for (int k = 0; k < 15; ++k) c += s > kNf4Midpoint[k] ? 1u : 0u;
  return c;
}

inline std::int8_t int8_code(float v, float amax) {
  float q = (v / amax) * kInt8Levels;
  q = (q == q) ? round_even_s(q) : 0.0f;  // |q| <= 127 for every non-NaN q
  return static_cast<std::int8_t>(static_cast<int>(q));
}

// ---- vector layer (kW floats per vector; kW == 0: no vector path) --------------------------------

// ---- the NF4 code by lookup (the vector Nf4Quantizers) ----------------------------------------
// bin b = trunc(fma(s, 16, 16)), clamped to 31, puts s in [(b - e) / 16 - 1, (b + 1 + e) / 16 - 1]
// with e = 2^-18 (|fma(s, 16, 16)| <= 32: its rounding error is at most 2^-19). first[b] counts the
// midpoints below that window's start: all of them lie below s. As no two midpoints are closer than
// the window is wide (asserted below), at most one more midpoint lies in it, and it is
// kNf4Midpoint[first[b]]: one strict compare with it completes the count of midpoints below s,
// which is the code (the same bytes as the scalar path; tests/test_quant_isa.py checks every bin
// edge and midpoint with the floats beside them).
constexpr bool nf4_midpoints_apart() {
  for (int i = 0; i + 1 < 15; ++i)
    if (static_cast<double>(kNf4Midpoint[i + 1]) - kNf4Midpoint[i] <= (1.0 + 0x1p-17) / 16.0) return false;
  return true;
}
static_assert(nf4_midpoints_apart(), "NF4 midpoints closer than a bin: the vector Nf4Quantizer needs more bins");

template <class T>
void nf4_first_codes(T* first) {  // first[b], b = 0..31
  for (int b = 0; b < 32; ++b) {
    const double start = (b - 0x1p-18) / 16.0 - 1.0;
    int c = 0;
    while (c < 15 && static_cast<double>(kNf4Midpoint[c]) < start) ++c;
    first[b] = static_cast<T>(c);
  }
}

#if RAMSTREAM_ISA_LEVEL >= 2
constexpr int64_t kW = 16;
using V = __m512;
inline V vset1(float f) { return _mm512_set1_ps(f); }
inline V vabs(V v) {
  return _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(0x7FFFFFFF)));
}
inline V vmul(V a, V b) { return _mm512_mul_ps(a, b); }
inline V vdiv(V a, V b) { return _mm512_div_ps(a, b); }
inline V vmax(V a, V b) { return _mm512_max_ps(a, b); }  // NaN a -> b
inline V vmin(V a, V b) { return _mm512_min_ps(a, b); }
inline float vhmax(V v) { return _mm512_reduce_max_ps(v); }
inline V vnan_to_zero(V v) { return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v, v, _CMP_ORD_Q), v); }

template <class T>
V vload(const void* base, int64_t i);
template <>
inline V vload<F32>(const void* base, int64_t i) {
  return _mm512_loadu_ps(static_cast<const float*>(base) + i);
}
template <>
inline V vload<BF16>(const void* base, int64_t i) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + i));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
template <>
inline V vload<F16>(const void* base, int64_t i) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + i));
  return _mm512_cvtph_ps(h);
}

template <class T>
void vstore(void* base, int64_t i, V v);
template <>
inline void vstore<F32>(void* base, int64_t i, V v) {
  _mm512_storeu_ps(static_cast<float*>(base) + i, v);
}
template <>
inline void vstore<BF16>(void* base, int64_t i, V v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i hi = _mm512_srli_epi32(u, 16);
  __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)),
                               _mm512_and_si512(hi, _mm512_set1_epi32(1)));
  r = _mm512_srli_epi32(r, 16);
  const __m512i nan = _mm512_or_si512(_mm512_and_si512(hi, _mm512_set1_epi32(0x8000)),
                                      _mm512_set1_epi32(0x7FC0));
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), nan);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(base) + i),
                      _mm512_cvtepi32_epi16(r));
}
template <>
inline void vstore<F16>(void* base, int64_t i, V v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(base) + i),
                      _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// NF4: codes of kW clamped, NaN-free values, packed into kW / 2 bytes at out, by lookup (above).
struct Nf4Quantizer {
  __m512i first_lo, first_hi;  // first[b], b = 0..15 and 16..31
  __m512 next;                 // next[c] = kNf4Midpoint[c], c = 0..14; next[15] = +inf (never below)
  Nf4Quantizer() {
    alignas(64) int32_t f[32];
    alignas(64) float nx[16];
    nf4_first_codes(f);
    for (int c = 0; c < 15; ++c) nx[c] = kNf4Midpoint[c];
    nx[15] = __builtin_inff();
    first_lo = _mm512_load_si512(f);
    first_hi = _mm512_load_si512(f + 16);
    next = _mm512_load_ps(nx);
  }
  void pack(V s, uint8_t* out) const {
    const __m512i bin = _mm512_min_epi32(
        _mm512_cvttps_epi32(_mm512_fmadd_ps(s, _mm512_set1_ps(16.0f), _mm512_set1_ps(16.0f))),
        _mm512_set1_epi32(31));
    __m512i c = _mm512_permutex2var_epi32(first_lo, bin, first_hi);
    const __mmask16 gt = _mm512_cmp_ps_mask(s, _mm512_permutexvar_ps(c, next), _CMP_GT_OQ);
    c = _mm512_mask_add_epi32(c, gt, c, _mm512_set1_epi32(1));
    // 64-bit lane j holds codes (2j, 2j+1) in its (low, high) halves: byte = lo << 4 | hi.
    const __m512i t = _mm512_or_si512(_mm512_slli_epi64(c, 4), _mm512_srli_epi64(c, 32));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm512_cvtepi64_epi8(t));
  }
};

// NF4: kW values from kW / 2 packed bytes (not yet scaled).
struct Nf4Decoder {
  __m512 table;
  Nf4Decoder() : table(_mm512_loadu_ps(kNf4Code)) {}
  V decode(const uint8_t* in) const {
    const __m512i b = _mm512_cvtepu8_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(in)));
    // low half: b >> 4; high half: b (permutexvar reads only the index's low 4 bits).
    const __m512i idx = _mm512_or_si512(_mm512_srli_epi64(b, 4), _mm512_slli_epi64(b, 32));
    return _mm512_permutexvar_ps(idx, table);
  }
};

inline void int8_store_codes(V v, std::int8_t* out) {  // v: NaN-free, |v| <= 127
  const __m512i q = _mm512_cvt_roundps_epi32(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtepi32_epi8(q));
}
inline V int8_load_codes(const std::int8_t* in) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in))));
}

#elif RAMSTREAM_ISA_LEVEL == 1
constexpr int64_t kW = 8;
using V = __m256;
inline V vset1(float f) { return _mm256_set1_ps(f); }
inline V vabs(V v) { return _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF))); }
inline V vmul(V a, V b) { return _mm256_mul_ps(a, b); }
inline V vdiv(V a, V b) { return _mm256_div_ps(a, b); }
inline V vmax(V a, V b) { return _mm256_max_ps(a, b); }  // NaN a -> b
inline V vmin(V a, V b) { return _mm256_min_ps(a, b); }
inline float vhmax(V v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}
inline V vnan_to_zero(V v) { return _mm256_and_ps(v, _mm256_cmp_ps(v, v, _CMP_ORD_Q)); }

template <class T>
V vload(const void* base, int64_t i);
template <>
inline V vload<F32>(const void* base, int64_t i) {
  return _mm256_loadu_ps(static_cast<const float*>(base) + i);
}
template <>
inline V vload<BF16>(const void* base, int64_t i) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + i));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
template <>
inline V vload<F16>(const void* base, int64_t i) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + i));
  return _mm256_cvtph_ps(h);
}

template <class T>
void vstore(void* base, int64_t i, V v);
template <>
inline void vstore<F32>(void* base, int64_t i, V v) {
  _mm256_storeu_ps(static_cast<float*>(base) + i, v);
}
template <>
inline void vstore<BF16>(void* base, int64_t i, V v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i hi = _mm256_srli_epi32(u, 16);
  __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)),
                               _mm256_and_si256(hi, _mm256_set1_epi32(1)));
  r = _mm256_srli_epi32(r, 16);
  const __m256i nan = _mm256_or_si256(_mm256_and_si256(hi, _mm256_set1_epi32(0x8000)),
                                      _mm256_set1_epi32(0x7FC0));
  r = _mm256_blendv_epi8(r, nan, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(base) + i), packed);
}
template <>
inline void vstore<F16>(void* base, int64_t i, V v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(base) + i),
                   _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// The same one-lookup, one-compare code as the AVX-512 Nf4Quantizer (its comment says why it is
// exact): first[b] by two byte shuffles (the bins' codes fit in a byte; the lookup's other bytes
// are masked off), the next midpoint by two permutes.
struct Nf4Quantizer {
  __m256i first_lo, first_hi;  // bytes first[0..15], first[16..31], in both 128-bit lanes
  __m256 next_lo, next_hi;     // kNf4Midpoint[0..7], kNf4Midpoint[8..14] and +inf
  Nf4Quantizer() {
    alignas(32) uint8_t f[32];
    alignas(32) float nx[16];
    nf4_first_codes(f);
    for (int c = 0; c < 15; ++c) nx[c] = kNf4Midpoint[c];
    nx[15] = __builtin_inff();
    const __m128i lo = _mm_load_si128(reinterpret_cast<const __m128i*>(f));
    const __m128i hi = _mm_load_si128(reinterpret_cast<const __m128i*>(f + 16));
    first_lo = _mm256_set_m128i(lo, lo);
    first_hi = _mm256_set_m128i(hi, hi);
    next_lo = _mm256_load_ps(nx);
    next_hi = _mm256_load_ps(nx + 8);
  }
  void pack(V s, uint8_t* out) const {
    const __m256i bin = _mm256_min_epi32(
        _mm256_cvttps_epi32(_mm256_fmadd_ps(s, _mm256_set1_ps(16.0f), _mm256_set1_ps(16.0f))),
        _mm256_set1_epi32(31));
    const __m256i upper = _mm256_cmpgt_epi32(bin, _mm256_set1_epi32(15));  // bin's bit 4
    __m256i c = _mm256_blendv_epi8(_mm256_shuffle_epi8(first_lo, bin), _mm256_shuffle_epi8(first_hi, bin), upper);
    c = _mm256_and_si256(c, _mm256_set1_epi32(0xFF));
    // permutevar8x32 reads the index's low 3 bits; bit 3 (moved to the sign) picks the half.
    const __m256 mid = _mm256_blendv_ps(_mm256_permutevar8x32_ps(next_lo, c), _mm256_permutevar8x32_ps(next_hi, c),
                                        _mm256_castsi256_ps(_mm256_slli_epi32(c, 28)));
    c = _mm256_sub_epi32(c, _mm256_castps_si256(_mm256_cmp_ps(s, mid, _CMP_GT_OQ)));
    const __m256i t = _mm256_or_si256(_mm256_slli_epi64(c, 4), _mm256_srli_epi64(c, 32));
    __m128i w = _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(t, _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6)));
    w = _mm_packus_epi16(_mm_packus_epi32(w, w), w);
    const int four = _mm_cvtsi128_si32(w);
    std::memcpy(out, &four, 4);
  }
};

struct Nf4Decoder {
  __m256 lo, hi;
  Nf4Decoder() : lo(_mm256_loadu_ps(kNf4Code)), hi(_mm256_loadu_ps(kNf4Code + 8)) {}
  V decode(const uint8_t* in) const {
    int four;
    std::memcpy(&four, in, 4);
    const __m256i b = _mm256_cvtepu8_epi64(_mm_cvtsi32_si128(four));
    const __m256i idx = _mm256_or_si256(_mm256_srli_epi64(b, 4), _mm256_slli_epi64(b, 32));
    // permutevar8x32 reads the index's low 3 bits; bit 3 (moved to the sign) picks the half.
    return _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo, idx), _mm256_permutevar8x32_ps(hi, idx),
                            _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
  }
};

inline void int8_store_codes(V v, std::int8_t* out) {  // v: NaN-free, |v| <= 127
  const __m256i q = _mm256_cvttps_epi32(_mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  const __m128i q16 = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm_packs_epi16(q16, q16));
}
inline V int8_load_codes(const std::int8_t* in) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(in))));
}

#else
constexpr int64_t kW = 0;
#endif

}  // namespace
}  // namespace ramstream::cpu::RAMSTREAM_ISA_NS
