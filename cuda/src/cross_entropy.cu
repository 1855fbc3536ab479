// Fused softmax cross-entropy for the chunked loss: a row's log-sum-exp in one read (forward) and
// its gradient written over the logits in one read and one write (backward).
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <string>

#include "numerics.cuh"
#include "ramstream/cuda/common.h"
#include "ramstream/cuda/cross_entropy.h"

namespace ramstream::cuda {
namespace {

constexpr int kRowThreads = 512;   // forward: one block per row
constexpr int kGradThreads = 256;  // backward: 8 elements (16 bytes of 16-bit logits) per thread
constexpr unsigned kMaxRowBlocks = 65535;

template <DType T>
__device__ __forceinline__ float load(const void* p, std::int64_t i) {
  if constexpr (T == DType::kFloat32) {
    return static_cast<const float*>(p)[i];
  } else if constexpr (T == DType::kBFloat16) {
    return detail::bf16_to_float(static_cast<const std::uint16_t*>(p)[i]);
  } else {
    return __half2float(static_cast<const __half*>(p)[i]);
  }
}

template <DType T>
__device__ __forceinline__ void store(void* p, std::int64_t i, float v) {
  if constexpr (T == DType::kFloat32) {
    static_cast<float*>(p)[i] = v;
  } else if constexpr (T == DType::kBFloat16) {
    static_cast<std::uint16_t*>(p)[i] = detail::float_to_bf16_rne(v);
  } else {
    static_cast<__half*>(p)[i] = __float2half_rn(v);
  }
}

// Running (max, sum of exp(x - max)); -inf entries add nothing.
struct MaxSum {
  float m;
  float s;
};

__device__ __forceinline__ void add(MaxSum& a, float x) {
  if (x > a.m) {
    a.s = a.s * expf(a.m - x) + 1.0f;  // a.m = -inf: a.s is 0, exp(-inf) = 0
    a.m = x;
  } else if (x != -INFINITY || a.m != -INFINITY) {
    a.s += expf(x - a.m);  // NaN x: NaN, as torch's log_softmax gives
  }
}

__device__ __forceinline__ MaxSum merge(MaxSum a, MaxSum b) {
  const float m = fmaxf(a.m, b.m);
  if (m == -INFINITY) return {m, a.s + b.s};  // 0, or NaN from a NaN entry
  // a part whose max is -inf holds only -inf entries (s = 0) or a NaN (s = NaN): s as it is
  const float s = (a.m == -INFINITY ? a.s : a.s * expf(a.m - m)) + (b.m == -INFINITY ? b.s : b.s * expf(b.m - m));
  return {m, s};
}

template <DType T>
__global__ void __launch_bounds__(kRowThreads)
    ce_forward_kernel(const void* __restrict__ logits, std::int64_t rows, std::int64_t vocab,
                      const std::int64_t* __restrict__ targets, float* __restrict__ lse,
                      float* __restrict__ target_logit) {
  __shared__ MaxSum warp_part[kRowThreads / 32];
  for (std::int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const std::int64_t base = r * vocab;
    MaxSum a{-INFINITY, 0.0f};
    for (std::int64_t c = threadIdx.x; c < vocab; c += blockDim.x) add(a, load<T>(logits, base + c));
    for (int o = 16; o > 0; o /= 2) {
      const MaxSum b{__shfl_down_sync(0xFFFFFFFFu, a.m, o), __shfl_down_sync(0xFFFFFFFFu, a.s, o)};
      a = merge(a, b);
    }
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    if (lane == 0) warp_part[warp] = a;
    __syncthreads();
    if (warp == 0) {
      a = lane < kRowThreads / 32 ? warp_part[lane] : MaxSum{-INFINITY, 0.0f};
      for (int o = 16; o > 0; o /= 2) {
        const MaxSum b{__shfl_down_sync(0xFFFFFFFFu, a.m, o), __shfl_down_sync(0xFFFFFFFFu, a.s, o)};
        a = merge(a, b);
      }
      if (lane == 0) {
        lse[r] = a.m == -INFINITY ? -INFINITY : a.m + logf(a.s);
        // a target outside [0, vocab) reads nothing: its loss is NaN (never another row's logit);
        // chunked_cross_entropy then names the bad target (loss.py, _check_range)
        const std::int64_t t = targets[r];
        target_logit[r] = (t >= 0 && t < vocab) ? load<T>(logits, base + t) : NAN;
      }
    }
    __syncthreads();  // warp_part is reused by the next row
  }
}

__device__ __forceinline__ float grad_of(float x, float l, float s, bool target) {
  const float g = expf(x - l) * s;
  return target ? g - s : g;
}

// kVec: every row starts 16-byte aligned and holds a whole number of 16-byte words.
template <DType T, bool kVec>
__global__ void __launch_bounds__(kGradThreads)
    ce_backward_kernel(void* __restrict__ logits, std::int64_t rows, std::int64_t vocab,
                       const std::int64_t* __restrict__ targets, const float* __restrict__ lse,
                       const float* __restrict__ scale) {
  constexpr int kPer = kVec ? (T == DType::kFloat32 ? 4 : 8) : 1;
  const std::int64_t units = vocab / kPer;
  const std::int64_t u0 = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const std::int64_t ustride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const float l = lse[r], s = scale[r];
    const std::int64_t t = targets[r], base = r * vocab;
    for (std::int64_t u = u0; u < units; u += ustride) {
      const std::int64_t c0 = u * kPer;
      if constexpr (kVec) {
        uint4* word = reinterpret_cast<uint4*>(static_cast<char*>(logits) + (base + c0) * static_cast<std::int64_t>(T == DType::kFloat32 ? 4 : 2));
        uint4 w = *word;
        auto* e = reinterpret_cast<unsigned char*>(&w);
#pragma unroll
        for (int k = 0; k < kPer; ++k) {
          if constexpr (T == DType::kFloat32) {
            float* f = reinterpret_cast<float*>(e) + k;
            *f = grad_of(*f, l, s, c0 + k == t);
          } else {
            std::uint16_t* h = reinterpret_cast<std::uint16_t*>(e) + k;
            const float x = T == DType::kBFloat16 ? detail::bf16_to_float(*h) : __half2float(__ushort_as_half(*h));
            const float g = grad_of(x, l, s, c0 + k == t);
            *h = T == DType::kBFloat16 ? detail::float_to_bf16_rne(g) : __half_as_ushort(__float2half_rn(g));
          }
        }
        *word = w;
      } else {
        store<T>(logits, base + c0, grad_of(load<T>(logits, base + c0), l, s, c0 == t));
      }
    }
  }
}

Status check_args(const char* fn, const void* logits, DType dtype, std::int64_t rows,
                  std::int64_t vocab, const void* targets, const void* a, const void* b) {
  if (rows < 0 || vocab < 1)
    return Status::invalid(std::string(fn) + ": rows must be >= 0 and vocab >= 1, got " +
                           std::to_string(rows) + " x " + std::to_string(vocab));
  if (!is_float_dtype(dtype))
    return Status::invalid(std::string(fn) + ": logits must be float32, bfloat16 or float16, got " +
                           dtype_name(dtype));
  if (rows > 0 && (logits == nullptr || targets == nullptr || a == nullptr || b == nullptr))
    return Status::invalid(std::string(fn) + ": a null pointer");
  return Status::ok();
}

template <DType T>
Status forward(const void* x, std::int64_t rows, std::int64_t vocab, const std::int64_t* t, float* lse,
               float* tl, cudaStream_t stream) {
  const unsigned grid = rows < kMaxRowBlocks ? static_cast<unsigned>(rows) : kMaxRowBlocks;
  (void)cudaGetLastError();
  ce_forward_kernel<T><<<grid, kRowThreads, 0, stream>>>(x, rows, vocab, t, lse, tl);
  return launch_status("ce_forward_kernel");
}

template <DType T>
Status backward(void* x, std::int64_t rows, std::int64_t vocab, const std::int64_t* t, const float* lse,
                const float* s, cudaStream_t stream) {
  constexpr int esize = T == DType::kFloat32 ? 4 : 2;
  const bool vec = reinterpret_cast<std::uintptr_t>(x) % 16 == 0 && (vocab * esize) % 16 == 0;
  const int per = vec ? 16 / esize : 1;
  const std::int64_t units = vocab / per;
  unsigned gx = static_cast<unsigned>((units + kGradThreads - 1) / kGradThreads);
  if (gx > 4096) gx = 4096;
  const unsigned gy = rows < kMaxRowBlocks ? static_cast<unsigned>(rows) : kMaxRowBlocks;
  const dim3 grid(gx, gy);
  (void)cudaGetLastError();
  if (vec) {
    ce_backward_kernel<T, true><<<grid, kGradThreads, 0, stream>>>(x, rows, vocab, t, lse, s);
  } else {
    ce_backward_kernel<T, false><<<grid, kGradThreads, 0, stream>>>(x, rows, vocab, t, lse, s);
  }
  return launch_status("ce_backward_kernel");
}

}  // namespace

Status ce_forward(const void* logits, DType dtype, std::int64_t rows, std::int64_t vocab,
                  const std::int64_t* targets, float* lse, float* target_logit, cudaStream_t stream) {
  RAMSTREAM_RETURN_IF_ERROR(check_args("ce_forward", logits, dtype, rows, vocab, targets, lse, target_logit));
  if (rows == 0) return Status::ok();
  switch (dtype) {
    case DType::kFloat32: return forward<DType::kFloat32>(logits, rows, vocab, targets, lse, target_logit, stream);
    case DType::kBFloat16: return forward<DType::kBFloat16>(logits, rows, vocab, targets, lse, target_logit, stream);
    default: return forward<DType::kFloat16>(logits, rows, vocab, targets, lse, target_logit, stream);
  }
}

Status ce_backward(void* logits, DType dtype, std::int64_t rows, std::int64_t vocab,
                   const std::int64_t* targets, const float* lse, const float* scale, cudaStream_t stream) {
  RAMSTREAM_RETURN_IF_ERROR(check_args("ce_backward", logits, dtype, rows, vocab, targets, lse, scale));
  if (rows == 0) return Status::ok();
  switch (dtype) {
    case DType::kFloat32: return backward<DType::kFloat32>(logits, rows, vocab, targets, lse, scale, stream);
    case DType::kBFloat16: return backward<DType::kBFloat16>(logits, rows, vocab, targets, lse, scale, stream);
    default: return backward<DType::kFloat16>(logits, rows, vocab, targets, lse, scale, stream);
  }
}

}  // namespace ramstream::cuda
