// Bindings for the pinned host arena: arena-backed tensors, statistics, budget, registration.
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <limits>
#include <vector>

#include "common.h"
#include "ramstream/host_memory.h"

namespace ramstream::py {

namespace {

using TorchArray = nb::ndarray<nb::pytorch>;

nb::dlpack::dtype dlpack_dtype(DType t) {
  switch (t) {
    case DType::kFloat32: return nb::dtype<float>();
    case DType::kBFloat16:
      return {static_cast<std::uint8_t>(nb::dlpack::dtype_code::Bfloat), 16, 1};
    case DType::kFloat16:
      return {static_cast<std::uint8_t>(nb::dlpack::dtype_code::Float), 16, 1};
    case DType::kUInt8: return nb::dtype<std::uint8_t>();
    case DType::kInt8: return nb::dtype<std::int8_t>();
  }
  return nb::dtype<std::uint8_t>();
}

void release_block(void* p) noexcept { (void)global_arena().release(p); }

// An arena-backed tensor of `shape` with elements of DLPack type `dt` (bits a multiple of 8);
// own_pages: HostArena::allocate's.
TorchArray arena_tensor(const std::vector<std::int64_t>& shape, nb::dlpack::dtype dt,
                        bool own_pages = false) {
  std::vector<std::size_t> dims(shape.size());
  std::size_t bytes = (dt.bits * dt.lanes + 7) / 8;
  bool overflow = false;
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] < 0)
      raise_value_error("pinned_empty: shape must hold non-negative sizes, got " +
                        std::to_string(shape[i]) + " at dimension " + std::to_string(i));
    dims[i] = static_cast<std::size_t>(shape[i]);
    if (dims[i] != 0 && bytes > std::numeric_limits<std::size_t>::max() / dims[i]) overflow = true;
    bytes *= dims[i];
  }
  if (overflow) raise_value_error("pinned_empty: the tensor's byte size overflows 64 bits");
  void* p = nullptr;
  check_without_gil([&] { return global_arena().allocate(bytes, &p, nullptr, own_pages); });
  nb::capsule owner(p, &release_block);  // frees the block when the tensor's storage dies
  return TorchArray(p, dims.size(), dims.data(), owner, nullptr, dt, nb::device::cpu::value, 0);
}

TorchArray pinned_empty(const std::vector<std::int64_t>& shape, int dtype_code) {
  if (dtype_code < 0 || dtype_code > static_cast<int>(DType::kInt8))
    raise_value_error("pinned_empty: dtype_code must be 0..4 (float32, bfloat16, float16, uint8, "
                      "int8), got " + std::to_string(dtype_code));
  return arena_tensor(shape, dlpack_dtype(static_cast<DType>(dtype_code)));
}

TorchArray pinned_empty_dlpack(const std::vector<std::int64_t>& shape, int type_code, int bits,
                               bool own_pages) {
  using C = nb::dlpack::dtype_code;
  const bool known = type_code == static_cast<int>(C::Int) || type_code == static_cast<int>(C::UInt) ||
                     type_code == static_cast<int>(C::Float) ||
                     type_code == static_cast<int>(C::Bfloat) || type_code == static_cast<int>(C::Bool);
  if (!known || bits < 8 || bits > 64 || bits % 8 != 0 || (bits & (bits - 1)) != 0)
    raise_value_error("pinned_empty_dlpack: unsupported DLPack dtype (code " +
                      std::to_string(type_code) + ", " + std::to_string(bits) + " bits)");
  return arena_tensor(shape,
                      nb::dlpack::dtype{static_cast<std::uint8_t>(type_code),
                                        static_cast<std::uint8_t>(bits), 1},
                      own_pages);
}

nb::dict stats_dict() {
  const HostMemoryStats s = global_arena().stats();
  nb::dict d;
  d["bytes_pinned"] = s.bytes_pinned;
  d["bytes_in_use"] = s.bytes_in_use;
  d["bytes_requested"] = s.bytes_requested;
  d["bytes_cached"] = s.bytes_cached;
  d["peak_bytes_in_use"] = s.peak_bytes_in_use;
  d["bytes_registered"] = s.bytes_registered;
  d["fallback_allocations"] = s.fallback_allocations;
  d["fallback_bytes_in_use"] = s.fallback_bytes_in_use;
  d["pin_calls"] = s.pin_calls;
  d["unpin_calls"] = s.unpin_calls;
  d["budget"] = s.budget;
  d["allocations"] = s.allocations;
  d["reuse_hits"] = s.reuse_hits;
  d["slabs"] = s.slabs;
  d["dedicated_blocks"] = s.dedicated_blocks;
  d["physical_memory"] = s.physical_memory;
  d["pinning_available"] = s.pinning_available;
  d["fallback_reason"] = s.fallback_reason;
  d["budget_source"] = s.budget_source;
  d["budget_error"] = s.budget_error;
  return d;
}

std::size_t byte_size(const Array& a) {
  const auto dt = a.dtype();
  return static_cast<std::size_t>(numel(a)) * ((dt.bits * dt.lanes + 7) / 8);
}

void* as_ptr(std::uintptr_t p) { return reinterpret_cast<void*>(p); }

}  // namespace

void bind_memory(nb::module_& m) {
  m.def("pinned_empty", &pinned_empty, nb::arg("shape"), nb::arg("dtype_code"),
        "An uninitialised CPU torch tensor (C-contiguous) whose storage is an arena block, pinned "
        "when a driver exists; the block returns to the arena when the tensor dies. dtype_code: "
        "0 float32, 1 bfloat16, 2 float16, 3 uint8, 4 int8. Thread-safe; releases the GIL.");
  m.def("pinned_empty_dlpack", &pinned_empty_dlpack, nb::arg("shape"), nb::arg("type_code"),
        nb::arg("bits"), nb::arg("own_pages") = false,
        "Internal: pinned_empty for any DLPack element type (type_code: 0 int, 1 uint, 2 float, "
        "4 bfloat, 6 bool; bits 8/16/32/64). own_pages: a dedicated allocation (no slab), given "
        "back to the driver by trim() once released.");
  m.def("memory_stats", &stats_dict, "A snapshot of the host arena's counters (a dict).");
  m.def(
      "set_pin_budget",
      [](std::int64_t bytes) {
        if (bytes < 0)
          raise_value_error("set_pin_budget: bytes must be >= 0, got " + std::to_string(bytes));
        check_without_gil([&] {
          return global_arena().set_budget(static_cast<std::uint64_t>(bytes));
        });
      },
      nb::arg("bytes"),
      "Sets the page-lock budget in bytes; cached pinned blocks are unpinned to fit when they can.");
  m.def("pin_budget", [] { return global_arena().budget(); }, "The page-lock budget in bytes.");
  m.def(
      "parse_pin_budget",
      [](const std::string& text) {
        std::uint64_t v = 0;
        check(parse_byte_size(text, physical_memory_bytes(), &v));
        return v;
      },
      nb::arg("text"),
      "Bytes meant by '8G', '512M', '1073741824' or '60%' (of physical RAM), as "
      "RAMSTREAM_PIN_BUDGET reads them; ValueError otherwise.");
  m.def("physical_memory_bytes", &physical_memory_bytes, "Physical RAM in bytes (0 if unknown).");
  m.def(
      "empty_cache",
      [] {
        check_without_gil([] { return global_arena().trim(); });
      },
      "Unpins fully free slabs and cached dedicated blocks (cudaFreeHost; synchronises the GPU).");
  m.def("reset_peak_memory_stats", [] { global_arena().reset_peak(); },
        "Sets peak_bytes_in_use to the current bytes_in_use.");
  m.def(
      "register_host_memory",
      [](Array t) {
        require_host_buffer(t, "tensor");
        const std::size_t bytes = byte_size(t);
        if (bytes == 0) raise_value_error("register_host_memory: tensor has no elements");
        void* p = t.data();
        check_without_gil([&] { return global_arena().register_memory(p, bytes); });
      },
      nb::arg("tensor").noconvert(),
      "Page-locks a contiguous CPU tensor's memory in place (cudaHostRegister), within the budget.");
  m.def(
      "unregister_host_memory",
      [](Array t) {
        require_host(t, "tensor");
        void* p = t.data();
        check_without_gil([&] { return global_arena().unregister_memory(p); });
      },
      nb::arg("tensor").noconvert(), "Undoes register_host_memory(tensor).");
  m.def(
      "is_arena_pinned",
      [](std::uintptr_t ptr) { return global_arena().is_pinned(as_ptr(ptr)); }, nb::arg("ptr"),
      "True when the address lies in memory the arena page-locked (block or registration).");
  m.def(
      "set_pin_device",
      [](int device) { check(global_arena().set_device(device)); }, nb::arg("device"),
      "Internal: the GPU whose context page-locking calls use (-1: the runtime's current one).");
  m.def(
      "host_device_pointer",
      [](std::uintptr_t ptr) {
        void* dev = nullptr;
        check(global_arena().device_pointer(as_ptr(ptr), &dev));
        return reinterpret_cast<std::uintptr_t>(dev);
      },
      nb::arg("ptr"), "Internal: the device address of mapped pinned host memory.");
  m.def(
      "arena_alloc",
      [](std::size_t bytes) {
        void* p = nullptr;
        bool pinned = false;
        check_without_gil([&] { return global_arena().allocate(bytes, &p, &pinned); });
        return std::make_pair(reinterpret_cast<std::uintptr_t>(p), pinned);
      },
      nb::arg("bytes"),
      "Internal (engine): a raw 4096-aligned arena block -> (address, pinned). Free it with "
      "arena_free; nothing frees it otherwise.");
  m.def(
      "arena_free",
      [](std::uintptr_t ptr) { check(global_arena().release(as_ptr(ptr))); }, nb::arg("ptr"),
      "Internal (engine): returns a block from arena_alloc to the arena.");
}

}  // namespace ramstream::py
