// CUDA sum of squares in double: grid-stride partial sums, block reduction, one atomicAdd per block.
#include <cuda_fp16.h>

#include <cstdint>
#include <string>

#include "numerics.cuh"
#include "ramstream/cuda/common.h"
#include "ramstream/cuda/norm.h"

namespace ramstream::cuda {
namespace {

constexpr int kThreads = 256;
constexpr unsigned kMaxBlocks = 1024;  // enough to fill an H200; bounds the atomics

template <DType T>
__device__ __forceinline__ double element_sq(const void* x, std::int64_t i) {
  float f;
  if constexpr (T == DType::kFloat32) {
    f = static_cast<const float*>(x)[i];
  } else if constexpr (T == DType::kBFloat16) {
    f = detail::bf16_to_float(static_cast<const std::uint16_t*>(x)[i]);
  } else {
    f = __half2float(static_cast<const __half*>(x)[i]);
  }
  const double d = f;
  return d * d;  // exact: a 24-bit mantissa squared fits in 53 bits
}

template <DType T>
__device__ __forceinline__ double word_sq(std::uint32_t w) {
  if constexpr (T == DType::kFloat32) {
    const double d = detail::bits_float(w);
    return d * d;
  } else {
    double s = 0.0;
    for (int k = 0; k < 2; ++k) {
      const auto h = static_cast<std::uint16_t>(k == 0 ? (w & 0xFFFFu) : (w >> 16));
      const double d = T == DType::kBFloat16 ? detail::bf16_to_float(h)
                                             : __half2float(__ushort_as_half(h));
      s += d * d;
    }
    return s;
  }
}

// kVec: x is 16-byte aligned; each step reads one 16-byte word (4 or 8 elements).
template <DType T, bool kVec>
__global__ void __launch_bounds__(kThreads)
    sq_norm_kernel(const void* __restrict__ x, std::int64_t n, double* __restrict__ out) {
  const std::int64_t tid = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  double s = 0.0;
  std::int64_t done = 0;  // elements covered by the vector loop
  if constexpr (kVec) {
    constexpr int kPer = T == DType::kFloat32 ? 4 : 8;
    const std::int64_t units = n / kPer;
    const auto* quads = static_cast<const uint4*>(x);
    for (std::int64_t u = tid; u < units; u += stride) {
      const uint4 q = __ldg(quads + u);
      s += word_sq<T>(q.x) + word_sq<T>(q.y) + word_sq<T>(q.z) + word_sq<T>(q.w);
    }
    done = units * kPer;
  }
  for (std::int64_t i = done + tid; i < n; i += stride) s += element_sq<T>(x, i);

  // Block reduction: warps by shuffles, then the first warp over the warp sums.
  __shared__ double warp_sums[kThreads / 32];
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  for (int o = 16; o > 0; o /= 2) s += __shfl_down_sync(0xFFFFFFFFu, s, o);
  if (lane == 0) warp_sums[warp] = s;
  __syncthreads();
  if (warp == 0) {
    s = lane < kThreads / 32 ? warp_sums[lane] : 0.0;
    for (int o = 16; o > 0; o /= 2) s += __shfl_down_sync(0xFFFFFFFFu, s, o);
    if (lane == 0) atomicAdd(out, s);
  }
}

template <DType T>
Status launch(const void* x, std::int64_t n, double* out, cudaStream_t stream) {
  const bool vector = reinterpret_cast<std::uintptr_t>(x) % 16 == 0;
  const int per = vector ? (T == DType::kFloat32 ? 4 : 8) : 1;
  unsigned grid = grid_for((n + per - 1) / per, kThreads);
  if (grid > kMaxBlocks) grid = kMaxBlocks;
  (void)cudaGetLastError();  // errors of earlier calls were reported by those calls
  if (vector) {
    sq_norm_kernel<T, true><<<grid, kThreads, 0, stream>>>(x, n, out);
  } else {
    sq_norm_kernel<T, false><<<grid, kThreads, 0, stream>>>(x, n, out);
  }
  return launch_status("sq_norm_kernel");
}

}  // namespace

Status sq_norm(const void* x, DType dtype, std::int64_t n, double* out_device, cudaStream_t stream,
               bool accumulate) {
  if (n < 0) return Status::invalid("sq_norm: n must be >= 0, got " + std::to_string(n));
  if (!is_float_dtype(dtype))
    return Status::invalid(std::string("sq_norm: x must be float32, bfloat16 or float16, got ") +
                           dtype_name(dtype));
  if (out_device == nullptr) return Status::invalid("sq_norm: out is a null pointer");
  if (n > 0 && x == nullptr) return Status::invalid("sq_norm: x is a null pointer");
  if (!accumulate)
    RAMSTREAM_RETURN_IF_ERROR(
        from_cuda(cudaMemsetAsync(out_device, 0, sizeof(double), stream), "sq_norm: cudaMemsetAsync"));
  if (n == 0) return Status::ok();
  switch (dtype) {
    case DType::kFloat32: return launch<DType::kFloat32>(x, n, out_device, stream);
    case DType::kBFloat16: return launch<DType::kBFloat16>(x, n, out_device, stream);
    default: return launch<DType::kFloat16>(x, n, out_device, stream);
  }
}

}  // namespace ramstream::cuda
