// CUDA dequantization of NF4 / int8 blockwise codes (docs/NUMERICS.md rules 4, 5): vectorised,
// grid-stride.
#include <cuda_fp16.h>

#include <cstdint>
#include <string>

#include "numerics.cuh"
#include "ramstream/cuda/common.h"
#include "ramstream/cuda/dequant.h"

namespace ramstream::cuda {
namespace {

using detail::f_mul;

constexpr int kThreads = 256;

// The NF4 code table; each block stages it into shared memory, where the per-thread
// (divergent) lookups are conflict-free, instead of serialising on the constant cache.
__constant__ float kNf4Table[16] = RAMSTREAM_NF4_TABLE;

enum class Out { kF32, kBF16, kF16 };

template <Out O>
__device__ __forceinline__ std::uint32_t to16(float x) {
  if constexpr (O == Out::kBF16) {
    return detail::float_to_bf16_rne(x);
  } else {
    return __half_as_ushort(__float2half_rn(x));  // IEEE RNE, incl. subnormals and overflow
  }
}

template <Out O>
__device__ __forceinline__ void store1(void* out, std::int64_t i, float x) {
  if constexpr (O == Out::kF32) {
    static_cast<float*>(out)[i] = x;
  } else {
    static_cast<std::uint16_t*>(out)[i] = static_cast<std::uint16_t>(to16<O>(x));
  }
}

// Stores x[0..7] to elements 8*u .. 8*u+7; `out` is 16-byte aligned.
template <Out O>
__device__ __forceinline__ void store8(void* out, std::int64_t u, const float* x) {
  if constexpr (O == Out::kF32) {
    float4* o = static_cast<float4*>(out) + 2 * u;
    o[0] = make_float4(x[0], x[1], x[2], x[3]);
    o[1] = make_float4(x[4], x[5], x[6], x[7]);
  } else {
    uint4 w;
    w.x = to16<O>(x[0]) | (to16<O>(x[1]) << 16);
    w.y = to16<O>(x[2]) | (to16<O>(x[3]) << 16);
    w.z = to16<O>(x[4]) | (to16<O>(x[5]) << 16);
    w.w = to16<O>(x[6]) | (to16<O>(x[7]) << 16);
    static_cast<uint4*>(out)[u] = w;
  }
}

__device__ __forceinline__ std::int64_t global_thread() {
  return static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ std::int64_t grid_threads() {
  return static_cast<std::int64_t>(gridDim.x) * blockDim.x;
}

// ---- NF4 -----------------------------------------------------------------------------------
// Vector path: packed 4-byte aligned, out 16-byte aligned. Unit u = packed bytes 4u..4u+3 =
// elements 8u..8u+7 (one 4-byte load, one or two 16-byte stores); elements past the last full
// unit (fewer than 8) are done one per thread. `block` is even, so both nibbles of a byte share
// a block, and a step of 2 elements crosses at most one block boundary.
template <Out O>
__global__ void __launch_bounds__(kThreads)
    dequantize_nf4_kernel(const std::uint8_t* __restrict__ packed,
                          const float* __restrict__ absmax, std::int64_t n, int block,
                          void* __restrict__ out) {
  __shared__ float table[16];
  if (threadIdx.x < 16) table[threadIdx.x] = kNf4Table[threadIdx.x];
  __syncthreads();

  const std::int64_t units = n / 8;
  const auto* words = reinterpret_cast<const std::uint32_t*>(packed);
  for (std::int64_t u = global_thread(); u < units; u += grid_threads()) {
    const std::uint32_t w = __ldg(words + u);
    const std::int64_t first = 8 * u;
    std::int64_t b = first / block;
    std::int64_t next = (b + 1) * block;  // first element of block b + 1
    float scale = __ldg(absmax + b);
    float x[8];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if (first + 2 * k >= next) {
        ++b;
        next += block;
        scale = __ldg(absmax + b);
      }
      const std::uint32_t byte = (w >> (8 * k)) & 0xFFu;
      x[2 * k] = f_mul(table[byte >> 4], scale);
      x[2 * k + 1] = f_mul(table[byte & 0xFu], scale);
    }
    store8<O>(out, u, x);
  }
  const std::int64_t e = 8 * units + global_thread();  // the tail
  if (e < n) {
    const std::uint32_t byte = packed[e / 2];
    const std::uint32_t code = (e & 1) ? (byte & 0xFu) : (byte >> 4);
    store1<O>(out, e, f_mul(table[code], absmax[e / block]));
  }
}

// Fallback for misaligned pointers: one packed byte (two elements) per step.
template <Out O>
__global__ void __launch_bounds__(kThreads)
    dequantize_nf4_scalar_kernel(const std::uint8_t* __restrict__ packed,
                                 const float* __restrict__ absmax, std::int64_t n, int block,
                                 void* __restrict__ out) {
  __shared__ float table[16];
  if (threadIdx.x < 16) table[threadIdx.x] = kNf4Table[threadIdx.x];
  __syncthreads();

  const std::int64_t bytes = (n + 1) / 2;
  for (std::int64_t j = global_thread(); j < bytes; j += grid_threads()) {
    const std::uint32_t byte = packed[j];
    const std::int64_t e = 2 * j;
    const float scale = absmax[e / block];
    store1<O>(out, e, f_mul(table[byte >> 4], scale));
    if (e + 1 < n) store1<O>(out, e + 1, f_mul(table[byte & 0xFu], scale));
  }
}

// ---- int8 ----------------------------------------------------------------------------------
__device__ __forceinline__ float int8_code(std::uint32_t word, int k) {
  return static_cast<float>(static_cast<std::int8_t>(static_cast<std::uint8_t>(word >> (8 * k))));
}

// Vector path: codes and out 16-byte aligned. Unit u = elements 16u..16u+15 (one 16-byte load,
// two to four 16-byte stores); a step of 1 element crosses at most one block boundary.
template <Out O>
__global__ void __launch_bounds__(kThreads)
    dequantize_int8_kernel(const std::int8_t* __restrict__ codes, const float* __restrict__ absmax,
                           std::int64_t n, int block, void* __restrict__ out) {
  const std::int64_t units = n / 16;
  const auto* quads = reinterpret_cast<const uint4*>(codes);
  for (std::int64_t u = global_thread(); u < units; u += grid_threads()) {
    const uint4 q = __ldg(quads + u);
    const std::uint32_t words[4] = {q.x, q.y, q.z, q.w};
    const std::int64_t first = 16 * u;
    std::int64_t b = first / block;
    std::int64_t next = (b + 1) * block;
    float scale = detail::int8_scale(__ldg(absmax + b));
    float x[16];
#pragma unroll
    for (int k = 0; k < 16; ++k) {
      if (first + k >= next) {
        ++b;
        next += block;
        scale = detail::int8_scale(__ldg(absmax + b));
      }
      x[k] = f_mul(int8_code(words[k / 4], k % 4), scale);
    }
    store8<O>(out, 2 * u, x);
    store8<O>(out, 2 * u + 1, x + 8);
  }
  const std::int64_t e = 16 * units + global_thread();  // the tail
  if (e < n) {
    const float scale = detail::int8_scale(absmax[e / block]);
    store1<O>(out, e, f_mul(static_cast<float>(codes[e]), scale));
  }
}

template <Out O>
__global__ void __launch_bounds__(kThreads)
    dequantize_int8_scalar_kernel(const std::int8_t* __restrict__ codes,
                                  const float* __restrict__ absmax, std::int64_t n, int block,
                                  void* __restrict__ out) {
  for (std::int64_t e = global_thread(); e < n; e += grid_threads()) {
    const float scale = detail::int8_scale(absmax[e / block]);
    store1<O>(out, e, f_mul(static_cast<float>(codes[e]), scale));
  }
}

// ---- launchers -----------------------------------------------------------------------------
bool aligned(const void* p, std::uintptr_t a) { return reinterpret_cast<std::uintptr_t>(p) % a == 0; }

Status check_args(const char* fn, const void* codes, const char* codes_name, const float* absmax,
                  std::int64_t n, void* out, DType out_dtype) {
  const std::string f(fn);
  if (n < 0) return Status::invalid(f + ": n must be >= 0, got " + std::to_string(n));
  if (!is_float_dtype(out_dtype))
    return Status::invalid(f + ": out must be float32, bfloat16 or float16, got " +
                           dtype_name(out_dtype));
  if (n > 0) {
    if (codes == nullptr) return Status::invalid(f + ": " + codes_name + " is a null pointer");
    if (absmax == nullptr) return Status::invalid(f + ": absmax is a null pointer");
    if (out == nullptr) return Status::invalid(f + ": out is a null pointer");
  }
  return Status::ok();
}

template <template <Out> class Launch, typename... Args>
Status dispatch_out(DType out_dtype, Args... args) {
  switch (out_dtype) {
    case DType::kFloat32: return Launch<Out::kF32>::run(args...);
    case DType::kBFloat16: return Launch<Out::kBF16>::run(args...);
    case DType::kFloat16: return Launch<Out::kF16>::run(args...);
    default: return Status::internal("dequantize: unreachable output dtype");
  }
}

template <Out O>
struct LaunchNf4 {
  static Status run(const std::uint8_t* packed, const float* absmax, std::int64_t n, int block,
                    void* out, cudaStream_t stream) {
    (void)cudaGetLastError();  // errors of earlier calls were reported by those calls
    if (aligned(packed, 4) && aligned(out, 16)) {
      dequantize_nf4_kernel<O><<<grid_for(n / 8, kThreads), kThreads, 0, stream>>>(
          packed, absmax, n, block, out);
      return launch_status("dequantize_nf4_kernel");
    }
    dequantize_nf4_scalar_kernel<O><<<grid_for((n + 1) / 2, kThreads), kThreads, 0, stream>>>(
        packed, absmax, n, block, out);
    return launch_status("dequantize_nf4_scalar_kernel");
  }
};

template <Out O>
struct LaunchInt8 {
  static Status run(const std::int8_t* codes, const float* absmax, std::int64_t n, int block,
                    void* out, cudaStream_t stream) {
    (void)cudaGetLastError();
    if (aligned(codes, 16) && aligned(out, 16)) {
      dequantize_int8_kernel<O><<<grid_for(n / 16, kThreads), kThreads, 0, stream>>>(
          codes, absmax, n, block, out);
      return launch_status("dequantize_int8_kernel");
    }
    dequantize_int8_scalar_kernel<O><<<grid_for(n, kThreads), kThreads, 0, stream>>>(
        codes, absmax, n, block, out);
    return launch_status("dequantize_int8_scalar_kernel");
  }
};

}  // namespace

Status dequantize_nf4(const std::uint8_t* packed, const float* absmax, std::int64_t n, int block,
                      void* out, DType out_dtype, cudaStream_t stream) {
  if (block < 2 || block % 2 != 0)
    return Status::invalid("dequantize_nf4: block_size must be even and >= 2, got " +
                           std::to_string(block));
  RAMSTREAM_RETURN_IF_ERROR(check_args("dequantize_nf4", packed, "packed", absmax, n, out, out_dtype));
  if (n == 0) return Status::ok();
  return dispatch_out<LaunchNf4>(out_dtype, packed, absmax, n, block, out, stream);
}

Status dequantize_int8(const std::int8_t* codes, const float* absmax, std::int64_t n, int block,
                       void* out, DType out_dtype, cudaStream_t stream) {
  if (block < 1)
    return Status::invalid("dequantize_int8: block_size must be >= 1, got " + std::to_string(block));
  RAMSTREAM_RETURN_IF_ERROR(check_args("dequantize_int8", codes, "codes", absmax, n, out, out_dtype));
  if (n == 0) return Status::ok();
  return dispatch_out<LaunchInt8>(out_dtype, codes, absmax, n, block, out, stream);
}

}  // namespace ramstream::cuda
