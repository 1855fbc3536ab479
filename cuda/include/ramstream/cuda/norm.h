// CUDA launcher: sum of squares of a flat buffer, accumulated in double on the device.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "ramstream/dtype.h"
#include "ramstream/status.h"

namespace ramstream::cuda {

// *out_device = sum_i double(x[i])^2 for x of `dtype` (float32, bfloat16 or float16), n elements.
// out_device is one device double; it is zeroed first (cudaMemsetAsync on `stream`) unless
// `accumulate`, in which case the sum is added to its current value (one norm over many
// buffers, read back once). Summation order is not fixed (atomicAdd of block sums), so the
// last bits may vary between runs. Asynchronous on `stream`; thread-safe; no GIL involved.
Status sq_norm(const void* x, DType dtype, std::int64_t n, double* out_device, cudaStream_t stream,
               bool accumulate = false);

}  // namespace ramstream::cuda
