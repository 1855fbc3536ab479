// CUDA launchers: dequantize NF4 / int8 blockwise codes to float32, bfloat16 or float16
// (docs/NUMERICS.md rules 4, 5).
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "ramstream/dtype.h"
#include "ramstream/status.h"

namespace ramstream::cuda {

// out[i] = nf4_table[code(i)] * absmax[i / block], in out_dtype (RNE, docs/NUMERICS.md rule 1).
// packed: (n + 1) / 2 bytes, element 2j in the high nibble of byte j, 2j+1 in the low nibble;
// absmax: ceil(n / block) floats; block: even, >= 2; out: n elements of out_dtype (float32,
// bfloat16 or float16). All pointers are device pointers (may be null when n == 0).
// Asynchronous on `stream`; thread-safe; no GIL involved. Bit-identical to the host kernels.
Status dequantize_nf4(const std::uint8_t* packed, const float* absmax, std::int64_t n, int block,
                      void* out, DType out_dtype, cudaStream_t stream);

// out[i] = float(codes[i]) * (absmax[i / block] / 127.0f), cast to out_dtype (RNE).
// codes: n int8; absmax: ceil(n / block) floats; block >= 1. Same contract as above.
Status dequantize_int8(const std::int8_t* codes, const float* absmax, std::int64_t n, int block,
                       void* out, DType out_dtype, cudaStream_t stream);

}  // namespace ramstream::cuda
