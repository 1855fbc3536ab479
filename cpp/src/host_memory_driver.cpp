// The page-locking driver of the host arena: the CUDA runtime's calls, or a driver that is never
// available without a CUDA build.
#include "ramstream/host_memory.h"

#include <mutex>
#include <string>
#include <unordered_map>

#include "host_memory_internal.h"
#include "host_pages.h"

#ifdef RAMSTREAM_WITH_CUDA
#include <cuda_runtime_api.h>

#include "ramstream/cuda/common.h"
#endif

namespace ramstream {

namespace {

using detail::fmt_ptr;

// ---- the CUDA driver (all calls are made without the arena's lock) ---------------------------
#ifdef RAMSTREAM_WITH_CUDA
Status select_device(int device) {
  if (device < 0) return Status::ok();
  return cuda::from_cuda(cudaSetDevice(device), "cudaSetDevice");
}

std::string cuda_availability() {
  int n = 0;
  cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return std::string("no usable CUDA driver or GPU (cudaGetDeviceCount: ") +
           cudaGetErrorName(err) + ", " + cudaGetErrorString(err) + ")";
  }
  return n > 0 ? std::string() : std::string("no CUDA device visible");
}

// Blocks pinned by map_touched + cudaHostRegister, with their sizes (for munmap); the others came
// from cudaHostAlloc. Never destroyed: the global arena unpins its blocks at exit, after any
// function-local static made later than it would be gone.
std::mutex& mapped_mu() {
  static auto* mu = new std::mutex;
  return *mu;
}
std::unordered_map<void*, std::size_t>& mapped_blocks() {
  static auto* m = new std::unordered_map<void*, std::size_t>;
  return *m;
}

constexpr std::size_t kRegisterMin = std::size_t{64} << 20;  // smaller blocks: cudaHostAlloc

Status cuda_pin(int device, std::size_t bytes, void** out) {
  *out = nullptr;
  RAMSTREAM_RETURN_IF_ERROR(select_device(device));
  const detail::PinMethod method = detail::pin_method();
  if (method == detail::PinMethod::kRegister && bytes >= kRegisterMin && bytes % 4096 == 0) {
    void* p = nullptr;
    RAMSTREAM_RETURN_IF_ERROR(detail::map_touched(bytes, detail::touch_threads(bytes), &p));
    cudaError_t err = cudaHostRegister(p, bytes, cudaHostRegisterPortable | cudaHostRegisterMapped);
    if (err != cudaSuccess) {
      cudaGetLastError();
      detail::unmap(p, bytes);
      return cuda::from_cuda(err, ("cudaHostRegister(" + std::to_string(bytes) + " bytes)").c_str());
    }
    std::lock_guard<std::mutex> g(mapped_mu());
    mapped_blocks()[p] = bytes;
    *out = p;
    return Status::ok();
  }
  cudaError_t err = cudaHostAlloc(out, bytes, cudaHostAllocPortable | cudaHostAllocMapped);
  if (err != cudaSuccess) {
    cudaGetLastError();
    *out = nullptr;
  }
  return cuda::from_cuda(err, ("cudaHostAlloc(" + std::to_string(bytes) + " bytes)").c_str());
}

void cuda_unpin(int device, void* p) {
  (void)select_device(device);
  std::size_t mapped = 0;
  {
    std::lock_guard<std::mutex> g(mapped_mu());
    auto it = mapped_blocks().find(p);
    if (it != mapped_blocks().end()) {
      mapped = it->second;
      mapped_blocks().erase(it);
    }
  }
  if (mapped) {
    if (cudaHostUnregister(p) != cudaSuccess) cudaGetLastError();
    detail::unmap(p, mapped);
    return;
  }
  if (cudaFreeHost(p) != cudaSuccess) cudaGetLastError();  // nothing else to do about it
}

Status cuda_register(int device, void* p, std::size_t bytes) {
  RAMSTREAM_RETURN_IF_ERROR(select_device(device));
  cudaError_t err = cudaHostRegister(p, bytes, cudaHostRegisterPortable | cudaHostRegisterMapped);
  if (err != cudaSuccess) cudaGetLastError();
  return cuda::from_cuda(err, "cudaHostRegister");
}

Status cuda_unregister(int device, void* p) {
  RAMSTREAM_RETURN_IF_ERROR(select_device(device));
  cudaError_t err = cudaHostUnregister(p);
  if (err != cudaSuccess) cudaGetLastError();
  return cuda::from_cuda(err, "cudaHostUnregister");
}

Status cuda_device_pointer(int device, void* host, void** dev) {
  *dev = nullptr;
  RAMSTREAM_RETURN_IF_ERROR(select_device(device));
  cudaError_t err = cudaHostGetDevicePointer(dev, host, 0);
  if (err != cudaSuccess) {
    cudaGetLastError();
    *dev = nullptr;
  }
  return cuda::from_cuda(err, ("cudaHostGetDevicePointer(" + fmt_ptr(host) + ")").c_str());
}
#else
Status no_cuda() { return Status::unsupported("ramstream was built without CUDA"); }
std::string cuda_availability() {
  return "ramstream was built without CUDA (RAMSTREAM_CUDA=OFF or no toolkit)";
}
Status cuda_pin(int, std::size_t, void** out) {
  *out = nullptr;
  return no_cuda();
}
void cuda_unpin(int, void*) {}
Status cuda_register(int, void*, std::size_t) { return no_cuda(); }
Status cuda_unregister(int, void*) { return no_cuda(); }
Status cuda_device_pointer(int, void*, void** dev) {
  *dev = nullptr;
  return no_cuda();
}
#endif

}  // namespace

const PinDriver& cuda_pin_driver() {
  static const PinDriver driver{&cuda_availability, &cuda_pin,        &cuda_unpin,
                                &cuda_register,     &cuda_unregister, &cuda_device_pointer};
  return driver;
}

}  // namespace ramstream
