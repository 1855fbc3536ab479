// CUDA launchers: softmax cross-entropy over one chunk of logits, fused (ramstream.loss).
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "ramstream/dtype.h"
#include "ramstream/status.h"

namespace ramstream::cuda {

// logits: `rows` x `vocab`, row-major and contiguous, float32/bfloat16/float16. For every row r:
// lse[r] = log(sum_c exp(x[r, c])) and target_logit[r] = x[r, targets[r]], both float32, the
// sum in float32 with a running maximum (one read of the row). targets[r] must be in
// [0, vocab) (the caller maps ignored rows to 0 and masks them). Asynchronous on `stream`.
Status ce_forward(const void* logits, DType dtype, std::int64_t rows, std::int64_t vocab,
                  const std::int64_t* targets, float* lse, float* target_logit, cudaStream_t stream);

// In place: x[r, c] <- exp(x[r, c] - lse[r]) * scale[r] - (c == targets[r] ? scale[r] : 0),
// rounded to the logits' dtype (nearest even): d loss / d logits of sum_r scale[r] * nll[r], as
// torch's cross_entropy backward orders it (softmax times the scale, then the target's term).
// One read and one write of the chunk. Asynchronous on `stream`.
Status ce_backward(void* logits, DType dtype, std::int64_t rows, std::int64_t vocab,
                   const std::int64_t* targets, const float* lse, const float* scale,
                   cudaStream_t stream);

}  // namespace ramstream::cuda
