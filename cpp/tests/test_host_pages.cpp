// Unit tests of host_pages (ctest): map_touched gives zero-filled, writable pages whatever the
// thread count (more threads than pages too), every page resident afterwards (mincore), bad sizes
// refused; pin_method reads RAMSTREAM_PIN_METHOD; touch_threads' bounds.
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "../src/host_pages.h"
#include "checks.h"

using namespace ramstream;
using namespace ramstream::detail;
using namespace ramstream::test;

namespace {

bool all_resident(void* p, std::size_t bytes) {
  const std::size_t page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> vec((bytes + page - 1) / page);
  if (mincore(p, bytes, vec.data()) != 0) return false;
  for (unsigned char v : vec)
    if (!(v & 1)) return false;
  return true;
}

void check_block(std::size_t bytes, int threads) {
  void* p = nullptr;
  CHECK_OK(map_touched(bytes, threads, &p));
  CHECK(p != nullptr);
  if (!p) return;
  CHECK(reinterpret_cast<std::uintptr_t>(p) % 4096 == 0);
  CHECK(all_resident(p, bytes));
  auto* b = static_cast<unsigned char*>(p);
  bool zero = true;
  for (std::size_t i = 0; i < bytes; i += 509) zero = zero && b[i] == 0;
  CHECK(zero && b[bytes - 1] == 0);
  for (std::size_t i = 0; i < bytes; i += 4096) b[i] = static_cast<unsigned char>(i / 4096 * 7);
  bool kept = true;
  for (std::size_t i = 0; i < bytes; i += 4096) kept = kept && b[i] == static_cast<unsigned char>(i / 4096 * 7);
  CHECK(kept);
  unmap(p, bytes);
}

}  // namespace

int main() {
  check_block(4096, 1);
  check_block(4096, 8);                    // more threads than pages
  check_block(std::size_t{3} << 20, 3);    // pages not a multiple of the thread count
  check_block(std::size_t{96} << 20, 4);
  check_block(std::size_t{64} << 20, 0);   // no thread asked: the caller's thread alone

  const std::uint64_t avail = available_memory_bytes();
  CHECK(avail > 0);  // Linux: /proc/meminfo
  if (avail > 0) {   // more than the machine has: refused before anything is touched
    void* big = reinterpret_cast<void*>(1);
    const std::size_t over = static_cast<std::size_t>((avail * 2 + 4095) / 4096 * 4096);
    Status s = map_touched(over, 4, &big);
    CHECK(s.code() == StatusCode::kOutOfMemory && big == nullptr);
    CHECK(s.message().find("MemAvailable") != std::string::npos);
  }

  void* p = reinterpret_cast<void*>(1);
  CHECK(map_touched(0, 2, &p).code() == StatusCode::kInvalidArgument && p == nullptr);
  CHECK(map_touched(4097, 2, &p).code() == StatusCode::kInvalidArgument && p == nullptr);

  unsetenv("RAMSTREAM_PIN_METHOD");
  CHECK(pin_method() == PinMethod::kRegister);
  setenv("RAMSTREAM_PIN_METHOD", "alloc", 1);
  CHECK(pin_method() == PinMethod::kAlloc);
  setenv("RAMSTREAM_PIN_METHOD", "register", 1);
  CHECK(pin_method() == PinMethod::kRegister);
  setenv("RAMSTREAM_PIN_METHOD", "fast", 1);  // bad: the default (Python's env check warns)
  CHECK(pin_method() == PinMethod::kRegister);
  unsetenv("RAMSTREAM_PIN_METHOD");

  CHECK(touch_threads(4096) == 1);
  CHECK(touch_threads(std::size_t{1} << 40) >= 1 && touch_threads(std::size_t{1} << 40) <= 16);
  CHECK(touch_threads(std::size_t{128} << 20) <= 2);
  return report("test_host_pages");
}
