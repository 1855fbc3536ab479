// A fake page-locking driver for the host arena's tests (ctest, no GPU): pinning is aligned_alloc,
// every call is counted and checked; with the helpers the arena tests share (allocation with its
// checks, the stats' invariants against what the fake holds). Thread-safe, as the arena needs.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>

#include "checks.h"
#include "ramstream/host_memory.h"

namespace ramstream::test {

inline constexpr std::size_t MiB = std::size_t{1} << 20;

namespace fake {
inline std::atomic<bool> available{true};
inline std::atomic<bool> fail_pin{false};
inline std::atomic<int> pins{0}, unpins{0}, errors{0};
inline std::mutex mu;
inline std::map<void*, std::size_t> pinned;      // live fake pins
inline std::map<void*, std::size_t> registered;  // live fake registrations

// Before each test: a driver that is available, pins succeed, nothing held, counters zero.
inline void reset() {
  available = true;
  fail_pin = false;
  pins = unpins = errors = 0;
  std::lock_guard<std::mutex> lock(mu);
  pinned.clear();
  registered.clear();
}
inline std::string availability() { return available ? std::string() : std::string("fake: no GPU"); }
inline Status pin(int, std::size_t bytes, void** out) {
  *out = nullptr;
  if (fail_pin) return Status::cuda("fake cudaHostAlloc failure");
  *out = std::aligned_alloc(4096, bytes);
  std::lock_guard<std::mutex> lock(mu);
  pinned[*out] = bytes;
  ++pins;
  return Status::ok();
}
inline void unpin(int, void* p) {
  std::lock_guard<std::mutex> lock(mu);
  if (pinned.erase(p) != 1) ++errors;  // unpinning something never pinned
  std::free(p);
  ++unpins;
}
inline Status reg(int, void* p, std::size_t bytes) {
  std::lock_guard<std::mutex> lock(mu);
  registered[p] = bytes;
  return Status::ok();
}
inline Status unreg(int, void* p) {
  std::lock_guard<std::mutex> lock(mu);
  if (registered.erase(p) != 1) ++errors;
  return Status::ok();
}
inline Status devptr(int, void* host, void** dev) {
  *dev = host;
  return Status::ok();
}
inline const PinDriver driver{&availability, &pin, &unpin, &reg, &unreg, &devptr};
}  // namespace fake

// The arena's stats agree with each other and with the bytes the fake driver holds pinned.
inline void check_invariants(const HostArena& a) {
  const HostMemoryStats s = a.stats();
  CHECK(s.bytes_cached == s.bytes_pinned - (s.bytes_in_use - s.fallback_bytes_in_use));
  CHECK(s.peak_bytes_in_use >= s.bytes_in_use);
  CHECK(s.bytes_requested <= s.bytes_in_use);
  std::lock_guard<std::mutex> lock(fake::mu);
  std::uint64_t held = 0;
  for (auto& kv : fake::pinned) held += kv.second;
  CHECK(held == s.bytes_pinned);
}

// a.allocate(n), checked: a page-aligned block whose whole requested range is writable.
inline void* alloc(HostArena& a, std::size_t n, bool* pinned = nullptr) {
  void* p = nullptr;
  CHECK_OK(a.allocate(n, &p, pinned));
  CHECK(p != nullptr);
  CHECK(reinterpret_cast<std::uintptr_t>(p) % 4096 == 0);
  if (p && n) std::memset(p, 0xAB, n);
  return p;
}

}  // namespace ramstream::test
