// CUDA AdamW over flat buffers (docs/NUMERICS.md rules 2, 3): moments in device or mapped pinned
// host memory.
//
// Memory-bound; with host-mapped moments every moment byte crosses PCIe once each way, so each
// thread moves 4 consecutive elements with one 16-byte (fp32) or 8-byte (bf16) access per
// array and a warp covers one contiguous 512 / 256-byte span per instruction.
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <string>

#include "numerics.cuh"
#include "ramstream/adamw_rules.h"
#include "ramstream/cuda/adamw.h"
#include "ramstream/cuda/common.h"

namespace ramstream::cuda {
namespace {

constexpr int kThreads = 256;

struct AdamWArgs {
  float* param;
  const void* grad;
  void* exp_avg;
  void* exp_avg_sq;
  void* out;  // null: no low-precision copy
  std::int64_t n;
  std::uint64_t offset;    // index of element 0 in the random stream
  std::uint32_t sr_base;   // detail::sr_key_base(seed, step)
  DType grad_dtype;
  DType out_dtype;
  detail::AdamWCoef c;
};

__device__ __forceinline__ std::int64_t global_thread() {
  return static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ std::int64_t grid_threads() {
  return static_cast<std::int64_t>(gridDim.x) * blockDim.x;
}

__device__ __forceinline__ float half_bits_to_float(std::uint32_t h) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(h)));
}
__device__ __forceinline__ float from16(std::uint32_t h, DType t) {
  return t == DType::kBFloat16 ? detail::bf16_to_float(static_cast<std::uint16_t>(h))
                               : half_bits_to_float(h);
}
__device__ __forceinline__ std::uint32_t to16(float x, DType t) {
  return t == DType::kBFloat16 ? detail::float_to_bf16_rne(x)
                               : __half_as_ushort(__float2half_rn(x));
}

// ---- one element -------------------------------------------------------------------------
__device__ __forceinline__ float load_grad1(const AdamWArgs& a, std::int64_t i) {
  if (a.grad_dtype == DType::kFloat32) return static_cast<const float*>(a.grad)[i];
  return from16(static_cast<const std::uint16_t*>(a.grad)[i], a.grad_dtype);
}

template <typename M>
__device__ __forceinline__ float load_moment1(const void* p, std::int64_t i) {
  if constexpr (sizeof(M) == 4) {
    return static_cast<const float*>(p)[i];
  } else {
    return detail::bf16_to_float(static_cast<const std::uint16_t*>(p)[i]);
  }
}

template <typename M>
__device__ __forceinline__ void store_moment1(void* p, std::int64_t i, float x, const AdamWArgs& a,
                                              std::uint32_t moment) {
  if constexpr (sizeof(M) == 4) {
    static_cast<float*>(p)[i] = x;
  } else {
    const std::uint32_t r = detail::sr_bits(a.sr_base, a.offset + static_cast<std::uint64_t>(i), moment);
    static_cast<std::uint16_t*>(p)[i] = detail::float_to_bf16_sr(x, r);
  }
}

__device__ __forceinline__ void store_out1(const AdamWArgs& a, std::int64_t i, float p) {
  if (a.out_dtype == DType::kFloat32) {
    static_cast<float*>(a.out)[i] = p;
  } else {
    static_cast<std::uint16_t*>(a.out)[i] = static_cast<std::uint16_t>(to16(p, a.out_dtype));
  }
}

template <typename M>
__device__ __forceinline__ void adamw_one(const AdamWArgs& a, std::int64_t i) {
  float p = a.param[i];
  float m = load_moment1<M>(a.exp_avg, i);
  float v = load_moment1<M>(a.exp_avg_sq, i);
  detail::adamw_math(a.c, p, load_grad1(a, i), m, v);
  a.param[i] = p;
  store_moment1<M>(a.exp_avg, i, m, a, 0);
  store_moment1<M>(a.exp_avg_sq, i, v, a, 1);
  if (a.out != nullptr) store_out1(a, i, p);
}

// ---- four elements (unit u = elements 4u..4u+3, all pointers suitably aligned) -------------
__device__ __forceinline__ void load4f(const void* p, std::int64_t u, float (&x)[4]) {
  const float4 t = static_cast<const float4*>(p)[u];
  x[0] = t.x;
  x[1] = t.y;
  x[2] = t.z;
  x[3] = t.w;
}
__device__ __forceinline__ void store4f(void* p, std::int64_t u, const float (&x)[4]) {
  static_cast<float4*>(p)[u] = make_float4(x[0], x[1], x[2], x[3]);
}
__device__ __forceinline__ void load4h(const void* p, std::int64_t u, std::uint32_t (&h)[4]) {
  const uint2 t = static_cast<const uint2*>(p)[u];  // little endian: element 0 in t.x's low half
  h[0] = t.x & 0xFFFFu;
  h[1] = t.x >> 16;
  h[2] = t.y & 0xFFFFu;
  h[3] = t.y >> 16;
}
__device__ __forceinline__ void store4h(void* p, std::int64_t u, const std::uint32_t (&h)[4]) {
  static_cast<uint2*>(p)[u] = make_uint2(h[0] | (h[1] << 16), h[2] | (h[3] << 16));
}

template <typename M>
__device__ __forceinline__ void load_moment4(const void* p, std::int64_t u, float (&x)[4]) {
  if constexpr (sizeof(M) == 4) {
    load4f(p, u, x);
  } else {
    std::uint32_t h[4];
    load4h(p, u, h);
#pragma unroll
    for (int k = 0; k < 4; ++k) x[k] = detail::bf16_to_float(static_cast<std::uint16_t>(h[k]));
  }
}

template <typename M>
__device__ __forceinline__ void store_moment4(void* p, std::int64_t u, const float (&x)[4],
                                              const AdamWArgs& a, std::uint32_t moment) {
  if constexpr (sizeof(M) == 4) {
    store4f(p, u, x);
  } else {
    std::uint32_t h[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const std::uint64_t idx = a.offset + static_cast<std::uint64_t>(4 * u + k);
      h[k] = detail::float_to_bf16_sr(x[k], detail::sr_bits(a.sr_base, idx, moment));
    }
    store4h(p, u, h);
  }
}

template <typename M>
__global__ void __launch_bounds__(kThreads) adamw_kernel(AdamWArgs a) {
  const std::int64_t units = a.n / 4;
  for (std::int64_t u = global_thread(); u < units; u += grid_threads()) {
    float p[4], g[4], m[4], v[4];
    load4f(a.param, u, p);
    if (a.grad_dtype == DType::kFloat32) {
      load4f(a.grad, u, g);
    } else {
      std::uint32_t h[4];
      load4h(a.grad, u, h);
#pragma unroll
      for (int k = 0; k < 4; ++k) g[k] = from16(h[k], a.grad_dtype);
    }
    load_moment4<M>(a.exp_avg, u, m);
    load_moment4<M>(a.exp_avg_sq, u, v);
#pragma unroll
    for (int k = 0; k < 4; ++k) detail::adamw_math(a.c, p[k], g[k], m[k], v[k]);
    store4f(a.param, u, p);
    store_moment4<M>(a.exp_avg, u, m, a, 0);
    store_moment4<M>(a.exp_avg_sq, u, v, a, 1);
    if (a.out != nullptr) {
      if (a.out_dtype == DType::kFloat32) {
        store4f(a.out, u, p);
      } else {
        std::uint32_t h[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) h[k] = to16(p[k], a.out_dtype);
        store4h(a.out, u, h);
      }
    }
  }
  const std::int64_t e = 4 * units + global_thread();  // the last n % 4 elements
  if (e < a.n) adamw_one<M>(a, e);
}

// Fallback for misaligned pointers: one element per step.
template <typename M>
__global__ void __launch_bounds__(kThreads) adamw_scalar_kernel(AdamWArgs a) {
  for (std::int64_t i = global_thread(); i < a.n; i += grid_threads()) adamw_one<M>(a, i);
}

// ---- host side -----------------------------------------------------------------------------
bool aligned(const void* p, std::uintptr_t a) { return reinterpret_cast<std::uintptr_t>(p) % a == 0; }

Status validate_buffers(const AdamWBuffers& b) {
  if (b.n < 0) return Status::invalid("adamw: n must be >= 0, got " + std::to_string(b.n));
  if (b.offset < 0)
    return Status::invalid("adamw: offset must be >= 0, got " + std::to_string(b.offset));
  if (!is_float_dtype(b.grad_dtype))
    return Status::invalid(std::string("adamw: grad must be float32, bfloat16 or float16, got ") +
                           dtype_name(b.grad_dtype));
  if (b.moment_dtype != DType::kFloat32 && b.moment_dtype != DType::kBFloat16)
    return Status::invalid(std::string("adamw: exp_avg and exp_avg_sq must be float32 or bfloat16, got ") +
                           dtype_name(b.moment_dtype));
  if (b.out != nullptr && !is_float_dtype(b.out_dtype))
    return Status::invalid(std::string("adamw: out must be float32, bfloat16 or float16, got ") +
                           dtype_name(b.out_dtype));
  if (b.n > 0) {
    if (b.param == nullptr) return Status::invalid("adamw: param is a null pointer");
    if (b.grad == nullptr) return Status::invalid("adamw: grad is a null pointer");
    if (b.exp_avg == nullptr) return Status::invalid("adamw: exp_avg is a null pointer");
    if (b.exp_avg_sq == nullptr) return Status::invalid("adamw: exp_avg_sq is a null pointer");
  }
  return Status::ok();
}

template <typename M>
Status launch(const AdamWArgs& a, bool vector, cudaStream_t stream) {
  (void)cudaGetLastError();  // errors of earlier calls were reported by those calls
  if (vector) {
    adamw_kernel<M><<<grid_for(a.n / 4, kThreads), kThreads, 0, stream>>>(a);
    return launch_status("adamw_kernel");
  }
  adamw_scalar_kernel<M><<<grid_for(a.n, kThreads), kThreads, 0, stream>>>(a);
  return launch_status("adamw_scalar_kernel");
}

}  // namespace

Status adamw(const AdamWBuffers& b, const AdamWHyper& h, cudaStream_t stream) {
  RAMSTREAM_RETURN_IF_ERROR(validate_buffers(b));
  RAMSTREAM_RETURN_IF_ERROR(adamw_hyper_status(h));
  if (b.n == 0) return Status::ok();

  AdamWArgs a;
  a.param = b.param;
  a.grad = b.grad;
  a.exp_avg = b.exp_avg;
  a.exp_avg_sq = b.exp_avg_sq;
  a.out = b.out;
  a.n = b.n;
  a.offset = static_cast<std::uint64_t>(b.offset);
  a.sr_base = detail::sr_key_base(h.seed, h.step);
  a.grad_dtype = b.grad_dtype;
  a.out_dtype = b.out_dtype;
  a.c = detail::make_adamw_coef(h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, h.step, h.grad_scale);

  // 4 elements per access: 16 bytes for float32 arrays, 8 bytes for 16-bit ones.
  auto width = [](DType t) -> std::uintptr_t { return t == DType::kFloat32 ? 16 : 8; };
  const bool vector = aligned(b.param, 16) && aligned(b.grad, width(b.grad_dtype)) &&
                      aligned(b.exp_avg, width(b.moment_dtype)) &&
                      aligned(b.exp_avg_sq, width(b.moment_dtype)) &&
                      (b.out == nullptr || aligned(b.out, width(b.out_dtype)));
  if (b.moment_dtype == DType::kFloat32) return launch<float>(a, vector, stream);
  return launch<std::uint16_t>(a, vector, stream);
}

}  // namespace ramstream::cuda
