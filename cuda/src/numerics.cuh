// Element numerics shared by the CUDA kernels (docs/NUMERICS.md rules 1-5), bit for bit the host's.
//
// Every float operation that must not be contracted into an FMA uses an explicit _rn intrinsic
// (__fmul_rn, __fadd_rn, ...): nvcc never fuses those, whatever -fmad says. The same functions
// also compile as plain C++ (no __CUDACC__): then they use ordinary operators, and the file must
// be compiled with -ffp-contract=off. tests/test_cuda_numerics_host.py does that to check this
// exact code against torch and the spec on a machine without a GPU.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#include "ramstream/hd.h"
#include "ramstream/rounding.h"

#define RS_HD RAMSTREAM_HD_INLINE

namespace ramstream::cuda::detail {

// ---- IEEE single operations, round to nearest even, never contracted ---------------------
RS_HD float f_add(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
RS_HD float f_sub(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
RS_HD float f_mul(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
RS_HD float f_div(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
RS_HD float f_sqrt(float a) {
#ifdef __CUDA_ARCH__
  return __fsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}
RS_HD float f_fma(float a, float b, float c) {
#ifdef __CUDA_ARCH__
  return __fmaf_rn(a, b, c);
#else
  return std::fmaf(a, b, c);
#endif
}

RS_HD std::uint32_t float_bits(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}
RS_HD float bits_float(std::uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

// ---- conversions (rule 1) ----------------------------------------------------------------
RS_HD float bf16_to_float(std::uint16_t h) { return bits_float(static_cast<std::uint32_t>(h) << 16); }

// Round to nearest even; NaN -> quiet 0x7FC0 with the sign kept.
RS_HD std::uint16_t float_to_bf16_rne(float f) {
  const std::uint32_t u = float_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<std::uint16_t>(((u >> 16) & 0x8000u) | 0x7FC0u);
  return static_cast<std::uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// ---- stochastic rounding of bf16 moments (rule 2) -----------------------------------------
// The hash itself is ramstream/rounding.h (shared with the host kernels); these are its names here.
// The (seed, step) part of the hash key, computed once per launch (sums commute mod 2^32).
RS_HD std::uint32_t sr_key_base(std::uint64_t seed, std::int64_t step) {
  return rounding::key_base(seed, step);
}

// 16 random bits for element `idx` (= index + offset) of moment 0 (exp_avg) or 1 (exp_avg_sq).
RS_HD std::uint32_t sr_bits(std::uint32_t key_base, std::uint64_t idx, std::uint32_t moment) {
  return rounding::bits(key_base, idx, moment);
}

// bf16 = (bits + r) >> 16; inf and NaN are truncated (NaN kept quiet).
RS_HD std::uint16_t float_to_bf16_sr(float f, std::uint32_t r) {
  const std::uint32_t u = float_bits(f);
  if ((u & 0x7F800000u) == 0x7F800000u) {
    std::uint32_t h = u >> 16;
    if (u & 0x007FFFFFu) h |= 0x0040u;
    return static_cast<std::uint16_t>(h);
  }
  return static_cast<std::uint16_t>((u + r) >> 16);
}

// ---- AdamW (rule 3: the vector-body formula of cpp/include/ramstream/adamw.h) ---------------
// Coefficients are computed on the host in double and rounded to float once (make_adamw_coef).
// lerp: m = fma(lerp_coeff, g - m, lerp_from_grad ? g : m), which is torch's
// lerp(m, g, w) with lerp_coeff = w, base m for |w| < 0.5 and lerp_coeff = w - 1, base g else.
struct AdamWCoef {
  float decay = 1.0f;           // float(1 - lr*wd), used when apply_decay
  float lerp_coeff = 0.1f;      // see above
  float beta2 = 0.999f;         // float(beta2)
  float one_minus_beta2 = 0.001f;  // float(1 - beta2)
  float bc2_sqrt = 1.0f;        // float(sqrt(1 - beta2^step))
  float neg_step_size = 0.0f;   // float(-lr / (1 - beta1^step))
  float eps = 1e-8f;            // float(eps)
  float grad_scale = 1.0f;      // used when apply_scale
  bool lerp_from_grad = false;
  bool apply_decay = false;     // weight_decay != 0
  bool apply_scale = false;     // grad_scale != 1
};

// The coefficients from the double hyper-parameters, each computed in double and rounded to float
// once (host only). Bias corrections use std::pow(beta, step), as torch does.
inline AdamWCoef make_adamw_coef(double lr, double beta1, double beta2, double eps,
                                 double weight_decay, std::int64_t step, float grad_scale) {
  AdamWCoef c;
  // volatile: keeps the host compiler from contracting 1 - lr*wd into an FMA (e.g. on aarch64),
  // which could change the last bit of the double and so, rarely, the float.
  volatile double lr_wd = lr * weight_decay;
  c.apply_decay = weight_decay != 0.0;
  c.decay = static_cast<float>(1.0 - lr_wd);
  const float w = static_cast<float>(1.0 - beta1);
  c.lerp_from_grad = !(std::fabs(w) < 0.5f);
  c.lerp_coeff = c.lerp_from_grad ? w - 1.0f : w;
  c.beta2 = static_cast<float>(beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  const double bias_correction1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const double bias_correction2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  c.bc2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
  c.neg_step_size = static_cast<float>(-(lr / bias_correction1));
  c.eps = static_cast<float>(eps);
  c.apply_scale = grad_scale != 1.0f;
  c.grad_scale = grad_scale;
  return c;
}

// One element: p, m, v updated in place from g (all float32).
RS_HD void adamw_math(const AdamWCoef& c, float& p, float g, float& m, float& v) {
  if (c.apply_scale) g = f_mul(g, c.grad_scale);
  if (c.apply_decay) p = f_mul(p, c.decay);
  const float base = c.lerp_from_grad ? g : m;
  m = f_fma(c.lerp_coeff, f_sub(g, m), base);
  v = f_fma(f_mul(c.one_minus_beta2, g), g, f_mul(v, c.beta2));  // torch fuses this line
  const float denom = f_add(f_div(f_sqrt(v), c.bc2_sqrt), c.eps);
  p = f_add(p, f_div(f_mul(c.neg_step_size, m), denom));
}

// ---- NF4 code table (rule 4) --------------------------------------------------------------
#define RAMSTREAM_NF4_TABLE                                                                  \
  {                                                                                          \
    -1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f,                \
        -0.28444138169288635f, -0.18477343022823334f, -0.09105003625154495f, 0.0f,           \
        0.07958029955625534f, 0.16093020141124725f, 0.24611230194568634f,                    \
        0.33791524171829224f, 0.44070982933044434f, 0.5626170039176941f,                     \
        0.7229568362236023f, 1.0f                                                            \
  }

// int8 dequant scale of one block (rule 5): absmax / 127 in float, once per block.
RS_HD float int8_scale(float absmax) { return f_div(absmax, 127.0f); }

}  // namespace ramstream::cuda::detail
