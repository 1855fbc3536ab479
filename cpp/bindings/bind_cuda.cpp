// Bindings for the CUDA kernels: NF4/int8 dequantization, AdamW with device or host-mapped moments
// ("gpu" optimizer mode) and squared norms. Compiled in every build; without CUDA each function
// raises RuntimeError.
//
// Streams are plain integers (torch.cuda.current_stream(device).cuda_stream). ramstream links the
// CUDA runtime statically, so it keeps its own "current device" apart from torch's dynamic
// runtime (both share the driver's primary context, hence pointers and streams interoperate):
// every function therefore takes `device` (default: the device of its first CUDA tensor) and
// calls cudaSetDevice(device) on the calling thread before touching memory or launching.
// Checks run before any CUDA call; launches are asynchronous on `stream`, with the GIL released.
#include <nanobind/stl/optional.h>

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>

#include "common.h"

#ifdef RAMSTREAM_WITH_CUDA
#include <cuda_runtime_api.h>

#include "adamw_hyper.h"
#include "ramstream/adamw.h"
#include "ramstream/cuda/adamw.h"
#include "ramstream/cuda/common.h"
#include "ramstream/cuda/cross_entropy.h"
#include "ramstream/cuda/dequant.h"
#include "ramstream/cuda/norm.h"
#endif

namespace ramstream::py {
namespace {

using namespace nb::literals;

using OptArray = std::optional<Array>;
using OptDevice = std::optional<int>;

#ifdef RAMSTREAM_WITH_CUDA

// Contiguous CUDA tensor (device index checked later, once the device is chosen).
void require_cuda_buffer(const Array& a, const char* arg) {
  require_cuda(a, arg);
  require_contiguous(a, arg);
}

// Makes `device` (default: the device of `first`) current for this thread's CUDA runtime.
int select_device(OptDevice device, const Array& first) {
  const int d = device ? *device : first.device_id();
  if (d < 0) raise_value_error("device: must be >= 0, got " + std::to_string(d));
  check(cuda::from_cuda(cudaSetDevice(d), "cudaSetDevice"));
  return d;
}

void require_on_device(const Array& a, int device, const char* arg) {
  if (a.device_id() != device)
    raise_value_error(std::string(arg) + ": is on cuda:" + std::to_string(a.device_id()) +
                      ", expected cuda:" + std::to_string(device) + " (the device of the call)");
}

void require_float_dtype(const Array& a, const char* arg) {
  const DType t = dtype_of(a, arg);
  if (!is_float_dtype(t))
    raise_type_error(std::string(arg) + ": expected float32, bfloat16 or float16, got " +
                     dtype_name(t));
}

std::string cuda_error_text(cudaError_t err) {
  return std::string(cudaGetErrorName(err)) + ": " + cudaGetErrorString(err);
}

// The device address of a parameter or moment: a CUDA tensor on `device`, or host memory that is
// pinned and mapped into the device's address space (the GPU then reads/writes it over PCIe).
void* moment_pointer(const Array& a, int device, const char* arg) {
  require_contiguous(a, arg);
  if (a.device_type() == nb::device::cuda::value) {
    require_on_device(a, device, arg);
    return a.data();
  }
  require_host(a, arg);  // anything else (e.g. another accelerator) is a ValueError
  void* host = a.data();
  if (numel(a) == 0) return host;  // never dereferenced
  cudaPointerAttributes attr{};
  cudaError_t err = cudaPointerGetAttributes(&attr, host);
  if (err != cudaSuccess) {
    cudaGetLastError();
    raise_value_error(std::string(arg) + ": cannot query the host memory (" + cuda_error_text(err) +
                      "); allocate it pinned (pin_memory=True)");
  }
  if (attr.type == cudaMemoryTypeUnregistered)
    raise_value_error(std::string(arg) +
                      ": host tensor is not pinned; the GPU can only access pinned memory "
                      "(allocate it with pin_memory=True or call .pin_memory())");
  if (attr.devicePointer != nullptr) return attr.devicePointer;
  void* dev = nullptr;
  err = cudaHostGetDevicePointer(&dev, host, 0);
  if (err != cudaSuccess || dev == nullptr) {
    cudaGetLastError();
    raise_value_error(std::string(arg) + ": pinned host memory is not mapped for cuda:" +
                      std::to_string(device) + " (" + cuda_error_text(err) +
                      "); pin it with cudaHostAllocMapped / cudaHostRegisterMapped");
  }
  return dev;
}

// What a dequantize binding hands to its launcher once its arguments are checked.
struct DequantArgs {
  const void* codes;
  const float* absmax;
  std::int64_t n;  // out's elements
  void* out;
  DType out_dtype;
};

// The checks of cuda_dequantize_nf4 (nf4: uint8 `packed`, two codes per byte, even block_size)
// and cuda_dequantize_int8 (int8 `codes`); makes the device of the call current.
DequantArgs check_dequant(const Array& codes, const Array& absmax, const Array& out,
                          int block_size, OptDevice device, bool nf4) {
  const char* name = nf4 ? "packed" : "codes";
  require_cuda_buffer(codes, name);
  require_dtype(codes, nf4 ? DType::kUInt8 : DType::kInt8, name);
  require_cuda_buffer(absmax, "absmax");
  require_dtype(absmax, DType::kFloat32, "absmax");
  require_cuda_buffer(out, "out");
  require_float_dtype(out, "out");
  if (nf4 && (block_size < 2 || block_size % 2 != 0))
    raise_value_error("block_size: must be even and >= 2, got " + std::to_string(block_size));
  if (!nf4 && block_size < 1)
    raise_value_error("block_size: must be >= 1, got " + std::to_string(block_size));
  const std::int64_t n = numel(out);
  if (nf4)
    require_numel(codes, name, (n + 1) / 2, "(out's elements + 1) // 2");
  else
    require_numel(codes, name, n, "out");
  require_numel(absmax, "absmax", (n + block_size - 1) / block_size,
                "ceil(out's elements / block_size)");
  const int d = select_device(device, out);
  require_on_device(codes, d, name);
  require_on_device(absmax, d, "absmax");
  require_on_device(out, d, "out");
  return {codes.data(), static_cast<const float*>(absmax.data()), n, out.data(),
          dtype_of(out, "out")};
}

void cuda_dequantize_nf4(const Array& packed, const Array& absmax, const Array& out,
                         int block_size, std::uintptr_t stream, OptDevice device) {
  const DequantArgs a = check_dequant(packed, absmax, out, block_size, device, /*nf4=*/true);
  check_without_gil([&] {
    return cuda::dequantize_nf4(static_cast<const std::uint8_t*>(a.codes), a.absmax, a.n,
                                block_size, a.out, a.out_dtype, cuda::as_stream(stream));
  });
}

void cuda_dequantize_int8(const Array& codes, const Array& absmax, const Array& out,
                          int block_size, std::uintptr_t stream, OptDevice device) {
  const DequantArgs a = check_dequant(codes, absmax, out, block_size, device, /*nf4=*/false);
  check_without_gil([&] {
    return cuda::dequantize_int8(static_cast<const std::int8_t*>(a.codes), a.absmax, a.n,
                                 block_size, a.out, a.out_dtype, cuda::as_stream(stream));
  });
}

void cuda_adamw(const Array& param, const Array& grad, const Array& exp_avg,
                const Array& exp_avg_sq, const OptArray& out, double lr, double beta1,
                double beta2, double eps, double weight_decay, std::int64_t step,
                double grad_scale, std::uint64_t seed, std::int64_t offset, std::uintptr_t stream,
                OptDevice device) {
  require_dtype(param, DType::kFloat32, "param");  // CUDA, or pinned host (a mapped fp32 master)
  require_cuda_buffer(grad, "grad");
  require_float_dtype(grad, "grad");
  const DType mt = dtype_of(exp_avg, "exp_avg");
  if (mt != DType::kFloat32 && mt != DType::kBFloat16)
    raise_type_error(std::string("exp_avg: expected float32 or bfloat16, got ") + dtype_name(mt));
  require_dtype(exp_avg_sq, mt, "exp_avg_sq");
  if (out) {
    require_cuda_buffer(*out, "out");
    require_float_dtype(*out, "out");
  }
  const std::int64_t n = numel(param);
  require_numel(grad, "grad", n, "param");
  require_numel(exp_avg, "exp_avg", n, "param");
  require_numel(exp_avg_sq, "exp_avg_sq", n, "param");
  if (out) require_numel(*out, "out", n, "param");

  const int d = select_device(device, grad);
  require_on_device(grad, d, "grad");
  if (out) require_on_device(*out, d, "out");

  AdamWBuffers b;
  b.param = static_cast<float*>(moment_pointer(param, d, "param"));
  b.grad = grad.data();
  b.grad_dtype = dtype_of(grad, "grad");
  b.exp_avg = moment_pointer(exp_avg, d, "exp_avg");
  b.exp_avg_sq = moment_pointer(exp_avg_sq, d, "exp_avg_sq");
  b.moment_dtype = mt;
  if (out) {
    b.out = out->data();
    b.out_dtype = dtype_of(*out, "out");
  }
  b.n = n;
  b.offset = offset;

  const AdamWHyper h = make_hyper(lr, beta1, beta2, eps, weight_decay, step, grad_scale, seed);
  check_without_gil([&] { return cuda::adamw(b, h, cuda::as_stream(stream)); });
}

DType dtype_from_code(int code, const char* arg) {
  if (code < 0 || code > 2)
    raise_value_error(std::string(arg) + ": dtype code must be 0 (float32), 1 (bfloat16) or 2 "
                      "(float16), got " + std::to_string(code));
  return static_cast<DType>(code);
}

// The engine's hot path: device-accessible addresses (VRAM, or mapped pinned host memory whose
// device address equals its host address under UVA), no tensor objects, no DLPack.
void cuda_adamw_ptr(std::uintptr_t param, std::uintptr_t grad, int grad_dtype, std::uintptr_t m,
                    std::uintptr_t v, int moment_dtype, std::uintptr_t out, int out_dtype,
                    std::int64_t n, std::int64_t offset, double lr, double beta1, double beta2,
                    double eps, double weight_decay, std::int64_t step, double grad_scale,
                    std::uint64_t seed, std::uintptr_t stream, int device) {
  AdamWBuffers b;
  b.param = reinterpret_cast<float*>(param);
  b.grad = reinterpret_cast<const void*>(grad);
  b.grad_dtype = dtype_from_code(grad_dtype, "grad_dtype");
  b.exp_avg = reinterpret_cast<void*>(m);
  b.exp_avg_sq = reinterpret_cast<void*>(v);
  b.moment_dtype = dtype_from_code(moment_dtype, "moment_dtype");
  b.out = reinterpret_cast<void*>(out);
  b.out_dtype = dtype_from_code(out_dtype, "out_dtype");
  b.n = n;
  b.offset = offset;
  const AdamWHyper h = make_hyper(lr, beta1, beta2, eps, weight_decay, step, grad_scale, seed);
  check_without_gil([&] {
    RAMSTREAM_RETURN_IF_ERROR(cuda::from_cuda(cudaSetDevice(device), "cudaSetDevice"));
    return cuda::adamw(b, h, cuda::as_stream(stream));
  });
}

void cuda_sq_norm(const Array& x, const Array& out, bool accumulate, std::uintptr_t stream,
                  OptDevice device) {
  require_cuda_buffer(x, "x");
  require_float_dtype(x, "x");
  require_cuda_buffer(out, "out");
  if (!(out.dtype() == nb::dtype<double>()) || numel(out) != 1)
    raise_type_error("out: expected a 1-element float64 CUDA tensor");
  const int d = select_device(device, x);
  require_on_device(x, d, "x");
  require_on_device(out, d, "out");
  const void* p = x.data();
  const DType t = dtype_of(x, "x");
  const std::int64_t n = numel(x);
  auto* o = static_cast<double*>(out.data());
  check_without_gil([&] { return cuda::sq_norm(p, t, n, o, cuda::as_stream(stream), accumulate); });
}

// The checks shared by cuda_ce_forward/_backward: logits [rows, vocab] float, targets int64 [rows],
// the per-row vectors float32 [rows]; all CUDA, contiguous, on one device. Returns the device.
int ce_checks(const Array& logits, const Array& targets, const Array& a, const char* a_name, const Array& b,
              const char* b_name, OptDevice device) {
  require_cuda_buffer(logits, "logits");
  require_float_dtype(logits, "logits");
  if (logits.ndim() != 2) raise_value_error("logits: expected a 2-D [rows, vocab] tensor");
  const auto rows = static_cast<std::int64_t>(logits.shape(0));
  require_cuda_buffer(targets, "targets");
  if (!(targets.dtype() == nb::dtype<std::int64_t>())) raise_type_error("targets: expected an int64 tensor");
  require_numel(targets, "targets", rows, "logits' rows");
  const auto per_row = [rows](const Array& arr, const char* name) {
    require_cuda_buffer(arr, name);
    require_dtype(arr, DType::kFloat32, name);
    require_numel(arr, name, rows, "logits' rows");
  };
  per_row(a, a_name);
  per_row(b, b_name);
  const int d = select_device(device, logits);
  require_on_device(logits, d, "logits");
  require_on_device(targets, d, "targets");
  require_on_device(a, d, a_name);
  require_on_device(b, d, b_name);
  return d;
}

void cuda_ce_forward(const Array& logits, const Array& targets, const Array& lse, const Array& target_logit,
                     std::uintptr_t stream, OptDevice device) {
  ce_checks(logits, targets, lse, "lse", target_logit, "target_logit", device);
  const void* x = logits.data();
  const DType t = dtype_of(logits, "logits");
  const auto rows = static_cast<std::int64_t>(logits.shape(0));
  const auto vocab = static_cast<std::int64_t>(logits.shape(1));
  const auto* tg = static_cast<const std::int64_t*>(targets.data());
  auto* l = static_cast<float*>(lse.data());
  auto* tl = static_cast<float*>(target_logit.data());
  check_without_gil([&] { return cuda::ce_forward(x, t, rows, vocab, tg, l, tl, cuda::as_stream(stream)); });
}

void cuda_ce_backward(const Array& logits, const Array& targets, const Array& lse, const Array& scale,
                      std::uintptr_t stream, OptDevice device) {
  ce_checks(logits, targets, lse, "lse", scale, "scale", device);
  void* x = logits.data();
  const DType t = dtype_of(logits, "logits");
  const auto rows = static_cast<std::int64_t>(logits.shape(0));
  const auto vocab = static_cast<std::int64_t>(logits.shape(1));
  const auto* tg = static_cast<const std::int64_t*>(targets.data());
  const auto* l = static_cast<const float*>(lse.data());
  const auto* sc = static_cast<const float*>(scale.data());
  check_without_gil([&] { return cuda::ce_backward(x, t, rows, vocab, tg, l, sc, cuda::as_stream(stream)); });
}

#else  // no CUDA in this build: same signatures, each raises RuntimeError

[[noreturn]] void no_cuda(const char* fn) {
  throw std::runtime_error(std::string(fn) +
                           ": this build has no CUDA support (ramstream was built with "
                           "RAMSTREAM_CUDA=OFF or without a CUDA toolkit)");
}

void cuda_adamw_ptr(std::uintptr_t, std::uintptr_t, int, std::uintptr_t, std::uintptr_t, int,
                    std::uintptr_t, int, std::int64_t, std::int64_t, double, double, double,
                    double, double, std::int64_t, double, std::uint64_t, std::uintptr_t, int) {
  no_cuda("cuda_adamw_ptr");
}
void cuda_dequantize_nf4(const Array&, const Array&, const Array&, int, std::uintptr_t, OptDevice) {
  no_cuda("cuda_dequantize_nf4");
}
void cuda_dequantize_int8(const Array&, const Array&, const Array&, int, std::uintptr_t, OptDevice) {
  no_cuda("cuda_dequantize_int8");
}
void cuda_adamw(const Array&, const Array&, const Array&, const Array&, const OptArray&, double,
                double, double, double, double, std::int64_t, double, std::uint64_t, std::int64_t,
                std::uintptr_t, OptDevice) {
  no_cuda("cuda_adamw_");
}
void cuda_sq_norm(const Array&, const Array&, bool, std::uintptr_t, OptDevice) {
  no_cuda("cuda_sq_norm");
}
void cuda_ce_forward(const Array&, const Array&, const Array&, const Array&, std::uintptr_t, OptDevice) {
  no_cuda("cuda_ce_forward");
}
void cuda_ce_backward(const Array&, const Array&, const Array&, const Array&, std::uintptr_t, OptDevice) {
  no_cuda("cuda_ce_backward");
}

#endif

}  // namespace

void bind_cuda(nb::module_& m) {
  m.def("cuda_dequantize_nf4", &cuda_dequantize_nf4, "packed"_a.noconvert(), "absmax"_a.noconvert(),
        "out"_a.noconvert(), "block_size"_a = 64, "stream"_a = 0, "device"_a = nb::none(),
        "out[:] = NF4 codes `packed` (uint8, (n+1)//2) times `absmax` (float32, ceil(n/block_size)),\n"
        "n = out.numel(); out float32/bfloat16/float16. All CUDA, contiguous, on `device`.\n"
        "Asynchronous on `stream` (an integer cudaStream_t); GIL released.");
  m.def("cuda_dequantize_int8", &cuda_dequantize_int8, "codes"_a.noconvert(), "absmax"_a.noconvert(),
        "out"_a.noconvert(), "block_size"_a = 64, "stream"_a = 0, "device"_a = nb::none(),
        "out[:] = int8 `codes` (n) times absmax/127 (float32, ceil(n/block_size)); as above.");
  m.def("cuda_adamw_", &cuda_adamw, "param"_a.noconvert(), "grad"_a.noconvert(),
        "exp_avg"_a.noconvert(), "exp_avg_sq"_a.noconvert(), "out"_a.noconvert().none(),
        nb::kw_only(), "lr"_a, "beta1"_a, "beta2"_a, "eps"_a, "weight_decay"_a, "step"_a,
        "grad_scale"_a = 1.0, "seed"_a = 0, "offset"_a = 0, "stream"_a = 0,
        "device"_a = nb::none(),
        "One AdamW step in place. param (float32), grad (float32/bfloat16/float16) and out\n"
        "(optional, float32/bfloat16/float16: the new weight, RNE) are CUDA tensors; exp_avg and\n"
        "exp_avg_sq (float32, or bfloat16 with stochastic rounding) are CUDA tensors or pinned\n"
        "host tensors, which the kernel reads and writes over PCIe. Same numel, contiguous.\n"
        "Asynchronous on `stream`; GIL released.");
  m.def("cuda_adamw_ptr", &cuda_adamw_ptr, "param"_a, "grad"_a, "grad_dtype"_a, "exp_avg"_a,
        "exp_avg_sq"_a, "moment_dtype"_a, "out"_a, "out_dtype"_a, "n"_a, "offset"_a, "lr"_a,
        "beta1"_a, "beta2"_a, "eps"_a, "weight_decay"_a, "step"_a, "grad_scale"_a, "seed"_a,
        "stream"_a, "device"_a,
        "Internal (engine hot path): cuda_adamw_ on raw device-accessible addresses (0 = no out),\n"
        "dtype codes 0/1/2 = float32/bfloat16/float16. Asynchronous on `stream`; GIL released.");
  m.def("cuda_sq_norm", &cuda_sq_norm, "x"_a.noconvert(), "out"_a.noconvert(), nb::kw_only(),
        "accumulate"_a = false, "stream"_a = 0, "device"_a = nb::none(),
        "out[0] (a 1-element float64 CUDA tensor) = sum of squares of x (float32/bfloat16/\n"
        "float16, CUDA, contiguous) in double; zeroed first unless accumulate. Asynchronous on\n"
        "`stream` (read out after it); GIL released.");
  m.def("cuda_ce_forward", &cuda_ce_forward, "logits"_a.noconvert(), "targets"_a.noconvert(),
        "lse"_a.noconvert(), "target_logit"_a.noconvert(), nb::kw_only(), "stream"_a = 0,
        "device"_a = nb::none(),
        "Per row of logits ([rows, vocab], float32/bfloat16/float16): lse[r] = logsumexp(x[r])\n"
        "and target_logit[r] = x[r, targets[r]] (float32 [rows]; targets int64 in [0, vocab)).\n"
        "All CUDA, contiguous, on `device`. Asynchronous on `stream`; GIL released.");
  m.def("cuda_ce_backward", &cuda_ce_backward, "logits"_a.noconvert(), "targets"_a.noconvert(),
        "lse"_a.noconvert(), "scale"_a.noconvert(), nb::kw_only(), "stream"_a = 0,
        "device"_a = nb::none(),
        "In place: logits[r, c] = exp(x - lse[r]) * scale[r] - (c == targets[r]) * scale[r], rounded\n"
        "to the logits' dtype: the gradient of sum_r scale[r] * nll[r]. As cuda_ce_forward.");
}

}  // namespace ramstream::py
