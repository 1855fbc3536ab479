// Host AdamW, gradient accumulation, squared L2 norms and casts over flat buffers, multithreaded.
//
// Numerics (the contract, verified bit for bit against torch 2.13's fused CPU AdamW,
// torch.optim.AdamW(fused=True), for fp32 state). Per element, all in float32 unless noted,
// with coefficients computed in double and rounded to float once:
//   g  = grad * float(grad_scale)                  (skipped when grad_scale == 1)
//   p  = p * float(1 - lr*wd)                      (skipped when wd == 0)
//   m  = fma(c, g - m, m)     with c = float(1-beta1)       when |c| <  0.5 (torch's lerp)
//   m  = fma(c - 1, g - m, g)                               when |c| >= 0.5 (beta1 <= 0.5)
//   v  = fma(float(1-beta2) * g, g, v * float(beta2))       (every element but the last n % 8)
//   v  = fma(v, float(beta2), (float(1-beta2) * g) * g)     (the last n % 8 elements)
//   d  = sqrt(v) / float(sqrt(1 - beta2^step)) + float(eps)
//   p  = p + (float(-lr / (1 - beta1^step)) * m) / d
// Why two forms of v: torch's kernel is compiled with floating-point contraction, so its
// `v*beta2 + (c2*g)*g` becomes an FMA; the vector body (16 floats) and the auto-vectorised
// 8-wide part of its scalar tail fuse the second product, the scalar remainder (n % 8) fuses
// the first. Only the n % 8 elements at the very end of the buffer are affected (torch splits
// work at multiples of 16 elements, and so do we). The CUDA kernel uses the first form for
// every element (docs/NUMERICS.md rule 3).
// Results are identical for every ISA (scalar, AVX2, AVX-512) and every thread count.
//
// bf16 moments are stored with stochastic rounding (docs/NUMERICS.md rule 2): the float's bits plus
// 16 random bits, truncated (unbiased). The random bits are a pure function of (seed, step,
// index + offset, moment), so results do not depend on threading or ISA. The optional `out`
// buffer receives the new weight rounded to nearest even (docs/NUMERICS.md rule 1) in the same pass.
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

// Validates the hyper-parameters by the rules of ramstream/adamw_rules.h (finite, lr >= 0,
// 0 <= beta < 1, eps > 0, wd >= 0, step >= 1, grad_scale finite), shared with the CUDA kernel.
// kInvalidArgument with a message naming the field otherwise.
Status validate_adamw_hyper(const AdamWHyper& h);

// One AdamW step over b.n elements on `pool`. Buffers must not overlap one another, except that
// `out` may be `grad` itself when both have the same dtype (the engine writes the new weights over
// the gradients it has just read). From 256K elements on, an `out` that shares no memory with the
// other buffers is written with non-temporal stores (it is never read: this spares the cache-line
// reads of write-allocate). On CPUs with AVX512-BF16 the AVX-512 kernel converts bf16 `out` with
// vcvtne2ps2bf16, with identical results (RAMSTREAM_AVX512BF16=0 turns that off).
// Thread-safe for disjoint buffers; no GIL needed. Calls below 32K elements run inline.
// The "last n % 8 elements" rule above applies to each call: an engine that splits one tensor
// into several calls should cut it at multiples of 16 elements to match torch on the whole.
Status adamw_step(const AdamWBuffers& b, const AdamWHyper& h, ThreadPool& pool);

// dst[i] += float(src[i]) (src float32/bfloat16/float16), one float add per element.
Status accumulate(float* dst, const void* src, DType src_dtype, std::int64_t n, ThreadPool& pool);

// Sum of squares of x (float32/bfloat16/float16), squares and sums in double. Blocks of 64K
// elements are summed in a fixed lane order and the block sums in index order, so the result
// is identical for every ISA and thread count.
Status sq_norm(const void* x, DType dtype, std::int64_t n, ThreadPool& pool, double* out);

// dst = float(src) * scale, element-wise cast into a float32 buffer (scale == 1: a plain cast).
Status cast_to_float(float* dst, const void* src, DType src_dtype, std::int64_t n, float scale,
                     ThreadPool& pool);

// The stochastic-rounding random bits of docs/NUMERICS.md rule 2 (moment 0 = exp_avg, 1 = exp_avg_sq),
// exposed for tests and for the CUDA kernel's reference: a value in [0, 65535].
std::uint32_t sr_bits(std::uint64_t seed, std::int64_t step, std::int64_t index, int moment);

}  // namespace ramstream
