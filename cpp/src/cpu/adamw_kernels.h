// Per-ISA entry points of the host AdamW / accumulate / squared-norm / cast kernels.
// Plain structs and declarations only: included by the dispatchers and by every ISA copy.
#pragma once
#include <cstdint>

namespace ramstream::cpu {

// Element types as seen by the kernels: the same values as ramstream::DType.
enum KernelDType : int { kKF32 = 0, kKBF16 = 1, kKF16 = 2 };

// Everything one AdamW call needs, precomputed by the dispatcher (adamw.cpp).
struct AdamWKernelArgs {
  float* param;
  const void* grad;
  void* exp_avg;
  void* exp_avg_sq;
  void* out;             // null: no low-precision copy
  int grad_dtype;        // KernelDType
  int moment_dtype;      // kKF32 or kKBF16
  int out_dtype;         // KernelDType (ignored when out is null)
  bool out_streaming;    // out may get non-temporal stores (large, overlaps no other buffer); the
                         // kernel uses them from the first 64-byte aligned element of its range
  bool bf16_cvt;         // AVX-512 kernel: the CPU has AVX512-BF16 (vcvtne2ps2bf16 for bf16 out)
  std::int64_t tail_begin;  // elements >= tail_begin use torch's scalar-remainder form of v
  std::int64_t offset;      // index of element 0 in the random stream
  // coefficients (see ramstream/adamw.h)
  float decay;           // float(1 - lr*wd); used when has_decay
  float lerp_coeff;      // c or c - 1
  float beta2;
  float c2;              // float(1 - beta2)
  float bc2_sqrt;        // float(sqrt(1 - beta2^step))
  float eps;
  float neg_step_size;   // float(-lr / (1 - beta1^step))
  float grad_scale;      // used when has_scale
  bool has_decay;
  bool has_scale;
  bool lerp_small;       // |c| < 0.5: base of the lerp is m, else g
  // stochastic rounding: hash key k = lo(idx)*A + hi(idx)*B + sr_key[moment]
  std::uint32_t sr_key[2];
};

// Sum-of-squares layout: lanes of one block (see sq_norm_block).
constexpr int kSqNormLanes = 32;

#define RAMSTREAM_DECLARE_ADAMW_KERNELS(isa)                                                   \
  namespace isa {                                                                              \
  /* AdamW on elements [begin, end) of the buffers in `a`; begin is a multiple of 16. */       \
  void adamw_range(const AdamWKernelArgs& a, std::int64_t begin, std::int64_t end);            \
  /* dst[i] += float(src[i]) for i in [begin, end). */                                         \
  void accumulate_range(float* dst, const void* src, int src_dtype, std::int64_t begin,        \
                        std::int64_t end);                                                     \
  /* dst[i] = float(src[i]) (* scale when has_scale) for i in [begin, end). */                 \
  void cast_range(float* dst, const void* src, int src_dtype, float scale, bool has_scale,     \
                  std::int64_t begin, std::int64_t end);                                       \
  /* Sum of x[i]^2 in double over [begin, end): element begin+j goes to lane j % 32, lanes   \
     are then added pairwise in a fixed order. Identical in every ISA. */                      \
  double sq_norm_block(const void* x, int dtype, std::int64_t begin, std::int64_t end);       \
  }

RAMSTREAM_DECLARE_ADAMW_KERNELS(scalar)
#if defined(RAMSTREAM_HAVE_X86_ISAS) || (defined(RAMSTREAM_ISA_LEVEL) && RAMSTREAM_ISA_LEVEL > 0)
RAMSTREAM_DECLARE_ADAMW_KERNELS(avx2)
RAMSTREAM_DECLARE_ADAMW_KERNELS(avx512)
#endif

#undef RAMSTREAM_DECLARE_ADAMW_KERNELS

}  // namespace ramstream::cpu
