// Error mapping and tensor checks shared by the binding files.
#include "common.h"

#include <Python.h>

namespace ramstream::py {

void raise_status(const Status& s) {
  switch (s.code()) {
    case StatusCode::kInvalidArgument: raise_value_error(s.message());
    case StatusCode::kOutOfMemory:
      PyErr_SetString(PyExc_MemoryError, s.message().c_str());
      throw nb::python_error();
    case StatusCode::kIoError: {
      // OSError(errno, message): Python picks the subclass (FileNotFoundError for ENOENT, ...).
      PyObject* args = Py_BuildValue("(is)", s.sys_errno(), s.message().c_str());
      PyErr_SetObject(PyExc_OSError, args);
      Py_XDECREF(args);
      throw nb::python_error();
    }
    default: throw std::runtime_error(s.message());
  }
}

void raise_value_error(const std::string& msg) { throw nb::value_error(msg.c_str()); }
void raise_type_error(const std::string& msg) { throw nb::type_error(msg.c_str()); }

DType dtype_of(const Array& a, const char* arg) {
  const auto dt = a.dtype();
  if (dt.lanes == 1) {
    if (dt == nb::dtype<float>()) return DType::kFloat32;
    if (dt == nb::dtype<std::uint8_t>()) return DType::kUInt8;
    if (dt == nb::dtype<std::int8_t>()) return DType::kInt8;
    if (dt.code == static_cast<std::uint8_t>(nb::dlpack::dtype_code::Bfloat) && dt.bits == 16)
      return DType::kBFloat16;
    if (dt.code == static_cast<std::uint8_t>(nb::dlpack::dtype_code::Float) && dt.bits == 16)
      return DType::kFloat16;
  }
  raise_type_error(std::string(arg) + ": unsupported dtype (code " + std::to_string(dt.code) +
                   ", " + std::to_string(dt.bits) +
                   " bits); accepted: float32, bfloat16, float16, uint8, int8");
}

std::int64_t numel(const Array& a) {
  std::int64_t n = 1;
  for (size_t i = 0; i < a.ndim(); ++i) n *= static_cast<std::int64_t>(a.shape(i));
  return n;
}

void require_contiguous(const Array& a, const char* arg) {
  std::int64_t expected = 1;
  for (size_t k = a.ndim(); k-- > 0;) {
    if (a.shape(k) != 1 && a.stride(k) != expected)
      raise_value_error(std::string(arg) +
                        ": must be contiguous (call .contiguous() first; an in-place argument is "
                        "never copied silently)");
    expected *= static_cast<std::int64_t>(a.shape(k));
  }
}

void require_host(const Array& a, const char* arg) {
  const int t = a.device_type();
  if (t != nb::device::cpu::value && t != nb::device::cuda_host::value)
    raise_value_error(std::string(arg) + ": must be a CPU tensor (got device type " +
                      std::to_string(t) + ")");
}

void require_cuda(const Array& a, const char* arg) {
  if (a.device_type() != nb::device::cuda::value)
    raise_value_error(std::string(arg) + ": must be a CUDA tensor (got device type " +
                      std::to_string(a.device_type()) + ")");
}

void require_dtype(const Array& a, DType want, const char* arg) {
  DType got = dtype_of(a, arg);
  if (got != want)
    raise_type_error(std::string(arg) + ": expected dtype " + dtype_name(want) + ", got " +
                     dtype_name(got));
}

void require_host_buffer(const Array& a, const char* arg) {
  require_host(a, arg);
  require_contiguous(a, arg);
}

void require_numel(const Array& a, const char* arg, std::int64_t n, const char* ref) {
  const std::int64_t k = numel(a);
  if (k != n)
    raise_value_error(std::string(arg) + ": has " + std::to_string(k) + " elements, " + ref + " has " +
                      std::to_string(n));
}

}  // namespace ramstream::py
