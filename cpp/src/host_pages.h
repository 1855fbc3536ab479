// Large page-lockable blocks faulted in by several threads (host_pages.cpp); the host arena's CUDA
// driver registers them instead of asking cudaHostAlloc (unless RAMSTREAM_PIN_METHOD=alloc).
#pragma once
#include <cstddef>
#include <cstdint>

#include "ramstream/status.h"

namespace ramstream::detail {

enum class PinMethod { kAlloc, kRegister };

// RAMSTREAM_PIN_METHOD: "alloc" (cudaHostAlloc); unset, "register" or anything else kRegister
// (map_touched + cudaHostRegister, 10x faster on the H100 machine: bench/train/probe_pin.py; a bad
// value is reported by Python's env check at import).
PinMethod pin_method();

// How many threads map_touched uses for `bytes`: one per 64 MiB, at most 16 and the core count.
int touch_threads(std::size_t bytes);

// MemAvailable of /proc/meminfo in bytes (0 when unreadable).
std::uint64_t available_memory_bytes();

// An anonymous private mapping of `bytes` (a positive multiple of 4096), zero-filled, every page
// faulted in by `threads` threads; asks for transparent huge pages and no inheritance by fork.
// Out of memory, touching nothing, when `bytes` exceeds MemAvailable.
Status map_touched(std::size_t bytes, int threads, void** out);

// munmap of a map_touched block.
void unmap(void* p, std::size_t bytes);

}  // namespace ramstream::detail
