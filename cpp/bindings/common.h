// Shared by every binding file: Status -> Python exception (also around a GIL-released call), and
// DLPack tensor checks that name the offending argument. The only place that maps error codes to
// exception types.
#pragma once
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <string>

#include "ramstream/dtype.h"
#include "ramstream/status.h"

namespace nb = nanobind;

namespace ramstream::py {

using Array = nb::ndarray<>;  // any DLPack tensor; dtype, device and layout are checked by hand

// kInvalidArgument -> ValueError, kOutOfMemory -> MemoryError, kIoError -> OSError(errno, message),
// anything else -> RuntimeError.
[[noreturn]] void raise_status(const Status& s);
inline void check(const Status& s) {
  if (!s.is_ok()) raise_status(s);
}
[[noreturn]] void raise_value_error(const std::string& msg);
[[noreturn]] void raise_type_error(const std::string& msg);

// Runs fn() (returning a Status) with the GIL released, then check()s its Status with the GIL held.
template <class Fn>
void check_without_gil(const Fn& fn) {
  Status s;
  {
    nb::gil_scoped_release release;
    s = fn();
  }
  check(s);
}

// The element type of `a`; TypeError naming `arg` when it is not one of ours.
DType dtype_of(const Array& a, const char* arg);
std::int64_t numel(const Array& a);
// ValueError naming `arg` unless `a` is C-contiguous (size-1 dimensions ignored).
void require_contiguous(const Array& a, const char* arg);
// ValueError naming `arg` unless `a` lives in host memory (CPU or pinned CUDA-host).
void require_host(const Array& a, const char* arg);
// ValueError naming `arg` unless `a` lives on a CUDA device.
void require_cuda(const Array& a, const char* arg);
// TypeError naming `arg` unless dtype_of(a) == want.
void require_dtype(const Array& a, DType want, const char* arg);
// Both checks above plus contiguity: the usual contract of an in-place host argument.
void require_host_buffer(const Array& a, const char* arg);
// ValueError "arg: has K elements, ref has n" unless numel(a) == n.
void require_numel(const Array& a, const char* arg, std::int64_t n, const char* ref);

// Registration functions, one per binding file.
void bind_system(nb::module_& m);
void bind_memory(nb::module_& m);
void bind_adamw(nb::module_& m);
void bind_quant(nb::module_& m);
void bind_cuda(nb::module_& m);
void bind_disk(nb::module_& m);

}  // namespace ramstream::py
