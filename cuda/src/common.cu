// Error conversion and launch-shape helpers for the CUDA launchers.
#include <string>

#include "ramstream/cuda/common.h"

namespace ramstream::cuda {

Status from_cuda(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return Status::ok();
  return Status::cuda(std::string(what) + ": " + cudaGetErrorName(err) + " (" +
                      cudaGetErrorString(err) + ")");
}

Status launch_status(const char* kernel) { return from_cuda(cudaGetLastError(), kernel); }

unsigned grid_for(std::int64_t n, int per_block) {
  std::int64_t blocks = (n + per_block - 1) / per_block;
  const std::int64_t cap = 65535LL * 32;  // grid-stride loops cover the rest
  if (blocks < 1) blocks = 1;
  if (blocks > cap) blocks = cap;
  return static_cast<unsigned>(blocks);
}

}  // namespace ramstream::cuda
