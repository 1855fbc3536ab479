// Large page-lockable blocks made the fast way: an anonymous mapping (transparent huge pages
// asked for, never inherited by a fork), its pages faulted in by several threads at once, so that
// the kernel zeroes them on several cores; cudaHostRegister then only locks pages that exist.
// cudaHostAlloc does the same work on the calling thread, 4 KiB page by page.
#include "host_pages.h"

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace ramstream::detail {

namespace {
constexpr std::size_t kPage = 4096;
constexpr std::size_t kPerThreadMin = std::size_t{64} << 20;  // less per thread: not worth a thread
}  // namespace

PinMethod pin_method() {
  const char* env = std::getenv("RAMSTREAM_PIN_METHOD");
  return env != nullptr && std::strcmp(env, "alloc") == 0 ? PinMethod::kAlloc : PinMethod::kRegister;
}

int touch_threads(std::size_t bytes) {
  const unsigned hw = std::max(1u, std::thread::hardware_concurrency());
  const std::size_t by_size = std::max<std::size_t>(1, bytes / kPerThreadMin);
  return static_cast<int>(std::min<std::size_t>({hw, by_size, std::size_t{16}}));
}

std::uint64_t available_memory_bytes() {
  std::FILE* f = std::fopen("/proc/meminfo", "r");
  if (f == nullptr) return 0;
  char line[256];
  std::uint64_t kib = 0;
  while (std::fgets(line, sizeof line, f) != nullptr) {
    unsigned long long v = 0;
    if (std::sscanf(line, "MemAvailable: %llu kB", &v) == 1) {
      kib = v;
      break;
    }
  }
  std::fclose(f);
  return kib * 1024;
}

Status map_touched(std::size_t bytes, int threads, void** out) {
  *out = nullptr;
  if (bytes == 0 || bytes % kPage != 0)
    return Status::invalid("map_touched: bytes must be a positive multiple of 4096, got " +
                           std::to_string(bytes));
  // Touching pages the machine does not have would bring the kernel's OOM killer, not an error:
  // refuse first, as cudaHostAlloc would (the arena then falls back and says why).
  const std::uint64_t avail = available_memory_bytes();
  if (avail > 0 && bytes > avail)
    return Status::oom("page-locking " + std::to_string(bytes) + " bytes: only " +
                       std::to_string(avail) + " bytes of RAM available (MemAvailable)");
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED)
    return Status::oom("mmap(" + std::to_string(bytes) + " bytes): " + std::strerror(errno));
  // Both are hints: a kernel without them still gives working (4 KiB, fork-inherited) pages.
#ifdef MADV_HUGEPAGE
  (void)madvise(p, bytes, MADV_HUGEPAGE);
#endif
#ifdef MADV_DONTFORK
  (void)madvise(p, bytes, MADV_DONTFORK);
#endif
  const std::size_t pages = bytes / kPage;
  const int n = std::max(1, std::min<int>(threads, static_cast<int>(std::min<std::size_t>(pages, 1 << 20))));
  const std::size_t per = (pages + n - 1) / n;
  auto touch = [p, pages, per](int i) {
    volatile char* base = static_cast<char*>(p);
    const std::size_t end = std::min(pages, (i + 1) * per);
    for (std::size_t k = i * per; k < end; ++k) base[k * kPage] = 0;
  };
  std::vector<std::thread> pool;
  try {
    for (int i = 1; i < n; ++i) pool.emplace_back(touch, i);
  } catch (...) {  // no more threads: this one touches what is left
    for (int i = static_cast<int>(pool.size()) + 1; i < n; ++i) touch(i);
  }
  touch(0);
  for (auto& t : pool) t.join();
  *out = p;
  return Status::ok();
}

void unmap(void* p, std::size_t bytes) {
  if (p != nullptr) (void)munmap(p, bytes);
}

}  // namespace ramstream::detail
