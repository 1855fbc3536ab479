// CUDA availability through the statically linked runtime; "no driver" means "no GPU", not an error.
#include "ramstream/device.h"

#ifdef RAMSTREAM_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace ramstream {

bool built_with_cuda() {
#ifdef RAMSTREAM_WITH_CUDA
  return true;
#else
  return false;
#endif
}

int cuda_runtime_version() {
#ifdef RAMSTREAM_WITH_CUDA
  return CUDART_VERSION;
#else
  return 0;
#endif
}

int cuda_device_count() {
#ifdef RAMSTREAM_WITH_CUDA
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error so later calls are not confused
    return 0;
  }
  return n;
#else
  return 0;
#endif
}

std::string cuda_unavailable_reason() {
#ifdef RAMSTREAM_WITH_CUDA
  int n = 0;
  cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return std::string("CUDA runtime: ") + cudaGetErrorString(err);
  }
  return n > 0 ? std::string() : std::string("no CUDA device");
#else
  return "this build of ramstream has no CUDA support (built with RAMSTREAM_CUDA=OFF or no toolkit)";
#endif
}

}  // namespace ramstream
