// Helpers shared by the host arena's sources (host_memory.cpp, host_memory_sizes.cpp,
// host_memory_driver.cpp); not part of the public API.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>

namespace ramstream::detail {

constexpr std::uint64_t kMaxRequest = std::uint64_t{1} << 50;  // 1 PiB: more than any host has

inline std::size_t round_up(std::size_t x, std::size_t m) { return (x + m - 1) / m * m; }

inline std::string fmt_ptr(const void* p) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%p", p);
  return buf;
}

}  // namespace ramstream::detail
