// Host AdamW, gradient accumulation and squared L2 norms over flat buffers, multithreaded.
//
// Numerics (the contract): per element, with g = grad * grad_scale (the multiply is skipped when
// grad_scale == 1), all in float32 unless noted:
//   p  = p * float(1 - lr*wd)                     (skipped when wd == 0)
//   m  = fma(float(1-beta1), g - m, m)            (torch's lerp; for 1-beta1 >= 0.5:
//                                                   m = fma(float(1-beta1) - 1, g - m, g))
//   v  = v * float(beta2) + (float(1-beta2) * g) * g
//   d  = sqrt(v) / float(sqrt(1 - beta2^step)) + float(eps)
//   p  = p + (float(-lr / (1 - beta1^step)) * m) / d
// coefficients computed in double and rounded to float once. This is torch's fused CPU AdamW
// (vector body); the last (n mod 16) elements of a buffer follow torch's scalar tail, where
// the products by 1-lr*wd, beta2 and 1-beta2 are taken in double. Results are identical for
// every ISA and thread count. Chunk boundaries are multiples of 16 elements.
//
// bf16 moments are stored with stochastic rounding: the float's bits plus 16 random bits,
// truncated (unbiased). The random bits are a pure function of (seed, step, index + offset,
// moment), so results do not depend on threading or ISA; see sr_bits() in adamw.cpp for the
// hash (the CUDA kernel uses the same one).
#pragma once
#include <cstdint>

#include "ramstream/dtype.h"
#include "ramstream/status.h"
#include "ramstream/thread_pool.h"

namespace ramstream {

struct AdamWHyper {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
  std::int64_t step = 1;       // the step being taken, >= 1 (bias correction uses it)
  float grad_scale = 1.0f;     // multiplies the gradient (clipping, averaging); 1 = untouched
  std::uint64_t seed = 0;      // stochastic rounding of bf16 moments
};

struct AdamWBuffers {
  float* param = nullptr;              // fp32 master, updated in place
  const void* grad = nullptr;          // grad_dtype: float32, bfloat16 or float16
  DType grad_dtype = DType::kFloat32;
  void* exp_avg = nullptr;             // moment_dtype: float32 or bfloat16
  void* exp_avg_sq = nullptr;
  DType moment_dtype = DType::kFloat32;
  void* out = nullptr;                 // optional: the new weight cast (RNE) to out_dtype
  DType out_dtype = DType::kBFloat16;  // float32, bfloat16 or float16
  std::int64_t n = 0;                  // elements
  std::int64_t offset = 0;             // index of element 0 in its state (random stream only)
};

// Validates the hyper-parameters (finite, lr >= 0, 0 <= beta < 1, eps > 0, wd >= 0, step >= 1).
Status validate_adamw_hyper(const AdamWHyper& h);

// One AdamW step over b.n elements on `pool`. Thread-safe for disjoint buffers; no GIL needed.
Status adamw_step(const AdamWBuffers& b, const AdamWHyper& h, ThreadPool& pool);

// dst[i] += float(src[i]) (src float32/bfloat16/float16), then optionally dst *= scale.
Status accumulate(float* dst, const void* src, DType src_dtype, std::int64_t n, ThreadPool& pool);

// Sum of squares of x (float32/bfloat16/float16), accumulated in double.
Status sq_norm(const void* x, DType dtype, std::int64_t n, ThreadPool& pool, double* out);

// dst = float(src) * scale, element-wise cast into a float32 buffer (scale == 1: a plain cast).
Status cast_to_float(float* dst, const void* src, DType src_dtype, std::int64_t n, float scale,
                     ThreadPool& pool);

}  // namespace ramstream
