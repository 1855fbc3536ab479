// Gradient accumulation, float casts and the squared L2 norm, compiled once per ISA.
#include "cpu/adamw_kernels.h"

#include "cpu/adamw_simd.h"

namespace ramstream::cpu::RAMSTREAM_ISA_NS {
namespace {

template <int D>
void accumulate_run(float* dst, const void* src, std::int64_t begin, std::int64_t end) {
  std::int64_t i = begin;
#if RAMSTREAM_ISA_LEVEL >= 2
  for (; i + 16 <= end; i += 16)
    _mm512_storeu_ps(dst + i, _mm512_add_ps(_mm512_loadu_ps(dst + i), load16<D>(src, i)));
#elif RAMSTREAM_ISA_LEVEL == 1
  for (; i + 8 <= end; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_add_ps(_mm256_loadu_ps(dst + i), load8<D>(src, i)));
#endif
  for (; i < end; ++i) dst[i] = dst[i] + load1<D>(src, i);
}

template <int D>
void cast_run(float* dst, const void* src, float scale, bool has_scale, std::int64_t begin,
              std::int64_t end) {
  std::int64_t i = begin;
#if RAMSTREAM_ISA_LEVEL >= 2
  const __m512 s = _mm512_set1_ps(scale);
  if (has_scale) {
    for (; i + 16 <= end; i += 16) _mm512_storeu_ps(dst + i, _mm512_mul_ps(load16<D>(src, i), s));
  } else {
    for (; i + 16 <= end; i += 16) _mm512_storeu_ps(dst + i, load16<D>(src, i));
  }
#elif RAMSTREAM_ISA_LEVEL == 1
  const __m256 s = _mm256_set1_ps(scale);
  if (has_scale) {
    for (; i + 8 <= end; i += 8) _mm256_storeu_ps(dst + i, _mm256_mul_ps(load8<D>(src, i), s));
  } else {
    for (; i + 8 <= end; i += 8) _mm256_storeu_ps(dst + i, load8<D>(src, i));
  }
#endif
  for (; i < end; ++i) dst[i] = has_scale ? load1<D>(src, i) * scale : load1<D>(src, i);
}

// Squares of floats are exact in double, so fma(x, x, acc) == acc + x*x: every ISA adds the
// same values into the same lane in the same order.
template <int D>
double sq_norm_run(const void* x, std::int64_t begin, std::int64_t end) {
  alignas(64) double lanes[kSqNormLanes] = {};
  std::int64_t i = begin;
#if RAMSTREAM_ISA_LEVEL >= 2
  __m512d acc0 = _mm512_setzero_pd(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
  for (; i + 32 <= end; i += 32) {
    const __m512 a = load16<D>(x, i), b = load16<D>(x, i + 16);
    const __m512d a0 = _mm512_cvtps_pd(_mm512_castps512_ps256(a));
    const __m512d a1 = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
    const __m512d b0 = _mm512_cvtps_pd(_mm512_castps512_ps256(b));
    const __m512d b1 = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(b), 1)));
    acc0 = _mm512_fmadd_pd(a0, a0, acc0);
    acc1 = _mm512_fmadd_pd(a1, a1, acc1);
    acc2 = _mm512_fmadd_pd(b0, b0, acc2);
    acc3 = _mm512_fmadd_pd(b1, b1, acc3);
  }
  _mm512_store_pd(lanes, acc0);
  _mm512_store_pd(lanes + 8, acc1);
  _mm512_store_pd(lanes + 16, acc2);
  _mm512_store_pd(lanes + 24, acc3);
#elif RAMSTREAM_ISA_LEVEL == 1
  __m256d acc[8];
  for (auto& r : acc) r = _mm256_setzero_pd();
  for (; i + 32 <= end; i += 32) {
    for (int k = 0; k < 4; ++k) {
      const __m256 a = load8<D>(x, i + 8 * k);
      const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(a));
      const __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(a, 1));
      acc[2 * k] = _mm256_fmadd_pd(lo, lo, acc[2 * k]);
      acc[2 * k + 1] = _mm256_fmadd_pd(hi, hi, acc[2 * k + 1]);
    }
  }
  for (int k = 0; k < 8; ++k) _mm256_store_pd(lanes + 4 * k, acc[k]);
#endif
  for (; i < end; ++i) {
    const double d = load1<D>(x, i);
    lanes[(i - begin) % kSqNormLanes] += d * d;
  }
  for (int s = kSqNormLanes / 2; s >= 1; s /= 2)
    for (int j = 0; j < s; ++j) lanes[j] += lanes[j + s];
  return lanes[0];
}

}  // namespace

void accumulate_range(float* dst, const void* src, int src_dtype, std::int64_t begin, std::int64_t end) {
  switch (src_dtype) {
    case kKF32: return accumulate_run<0>(dst, src, begin, end);
    case kKBF16: return accumulate_run<1>(dst, src, begin, end);
    default: return accumulate_run<2>(dst, src, begin, end);
  }
}

void cast_range(float* dst, const void* src, int src_dtype, float scale, bool has_scale,
                std::int64_t begin, std::int64_t end) {
  switch (src_dtype) {
    case kKF32: return cast_run<0>(dst, src, scale, has_scale, begin, end);
    case kKBF16: return cast_run<1>(dst, src, scale, has_scale, begin, end);
    default: return cast_run<2>(dst, src, scale, has_scale, begin, end);
  }
}

double sq_norm_block(const void* x, int dtype, std::int64_t begin, std::int64_t end) {
  switch (dtype) {
    case kKF32: return sq_norm_run<0>(x, begin, end);
    case kKBF16: return sq_norm_run<1>(x, begin, end);
    default: return sq_norm_run<2>(x, begin, end);
  }
}

}  // namespace ramstream::cpu::RAMSTREAM_ISA_NS
