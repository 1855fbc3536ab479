// Unit tests of the host arena's pinned path (size classes, byte sizes, slabs and their reuse,
// dedicated blocks, pin failures, registration, threads) with a fake page-locking driver
// (fake_driver.h), so that they run without a GPU (ctest). own_pages blocks and the page-lock
// budget: test_host_memory_budget.cpp.
#include <atomic>
#include <cstdio>
#include <cstring>
#include <map>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "fake_driver.h"
#include "ramstream/host_memory.h"

using namespace ramstream;
using namespace ramstream::test;

namespace {

// ---- tests -------------------------------------------------------------------------------------

void test_size_classes() {
  const std::pair<std::size_t, std::size_t> table[] = {
      {0, 4096},          {1, 4096},           {4096, 4096},       {4097, 8192},
      {5000, 8192},       {12288, 12288},      {12289, 16384},     {16385, 20480},
      {MiB, MiB},         {MiB + 1, MiB + MiB / 4}, {7 * MiB / 4 + 1, 2 * MiB}, {16 * MiB, 16 * MiB}};
  for (auto& [in, want] : table) {
    if (host_size_class(in) != want)
      std::fprintf(stderr, "host_size_class(%zu) = %zu, want %zu\n", in, host_size_class(in), want);
    CHECK(host_size_class(in) == want);
  }
  std::size_t prev = 0;
  for (std::size_t b = 1; b <= 16 * MiB; b = b * 9 / 8 + 1) {
    const std::size_t c = host_size_class(b);
    CHECK(c >= b && c % 4096 == 0 && c >= prev);
    if (b > 16384) CHECK(c * 4 <= b * 5);  // at most 25% rounding
    prev = c;
  }
}

void test_parse() {
  const std::uint64_t ram = std::uint64_t{64} << 30;
  const std::pair<const char*, std::uint64_t> good[] = {
      {"0", 0},           {"4096", 4096},      {"1k", 1024},        {"1K", 1024},
      {"1KiB", 1024},     {"2kb", 2048},       {"1M", MiB},         {"1.5G", 3ull << 29},
      {" 2 gb ", 2ull << 30}, {"1T", 1ull << 40}, {"50%", ram / 2}, {"100%", ram},
      {"12.5%", ram / 8}, {"7B", 7}};
  for (auto& [text, want] : good) {
    std::uint64_t v = 1;
    Status s = parse_byte_size(text, ram, &v);
    if (!s.is_ok() || v != want)
      std::fprintf(stderr, "parse_byte_size('%s') = %llu (%s), want %llu\n", text,
                   (unsigned long long)v, s.message().c_str(), (unsigned long long)want);
    CHECK(s.is_ok() && v == want);
  }
  for (const char* bad : {"", " ", "abc", "-1", "1X", "G", "101%", "1e9", "1..5", "nan", "inf",
                          "99999999999999999999T", "1 2"}) {
    std::uint64_t v = 7;
    Status s = parse_byte_size(bad, ram, &v);
    CHECK(s.code() == StatusCode::kInvalidArgument && v == 7);
  }
  std::uint64_t v = 0;
  CHECK(parse_byte_size("10%", 0, &v).code() == StatusCode::kInvalidArgument);  // RAM unknown
}

void test_reuse() {
  fake::reset();
  {
    HostArena a(fake::driver);
    bool pinned = false;
    void* p = alloc(a, 5000, &pinned);
    CHECK(pinned && a.is_pinned(p));
    HostMemoryStats s = a.stats();
    CHECK(s.pin_calls == 1 && s.slabs == 1 && s.bytes_pinned == HostArena::kSlabBytes);
    CHECK(s.bytes_in_use == 8192 && s.bytes_requested == 5000 && s.allocations == 1);
    CHECK(s.pinning_available && s.fallback_allocations == 0 && s.fallback_reason.empty());
    CHECK_OK(a.release(p));
    void* q = alloc(a, 6000);  // same class: the cached block, no driver call
    CHECK(q == p);
    s = a.stats();
    CHECK(s.pin_calls == 1 && s.reuse_hits == 1 && s.allocations == 2);
    void* r = alloc(a, 3 * MiB);  // another class, from the same slab's tail
    CHECK(a.stats().pin_calls == 1 && a.stats().reuse_hits == 1);
    CHECK(static_cast<char*>(r) >= static_cast<char*>(q) + 8192 ||
          static_cast<char*>(r) + 3 * MiB <= static_cast<char*>(q));
    check_invariants(a);
    CHECK_OK(a.release(q));
    CHECK_OK(a.release(r));
    CHECK(a.release(r).code() == StatusCode::kInvalidArgument);  // double release
    int x = 0;
    CHECK(a.release(&x).code() == StatusCode::kInvalidArgument);
    CHECK_OK(a.release(nullptr));
    CHECK(a.stats().bytes_in_use == 0 && a.stats().peak_bytes_in_use == 8192 + 3 * MiB);
    a.reset_peak();
    CHECK(a.stats().peak_bytes_in_use == 0);
    check_invariants(a);
  }
  CHECK(fake::pins == fake::unpins && fake::errors == 0);
}

void test_many_blocks_disjoint() {
  fake::reset();
  {
    HostArena a(fake::driver);
    std::mt19937 rng(5);
    std::vector<std::pair<char*, std::size_t>> live;
    for (int i = 0; i < 600; ++i) {
      std::size_t n = std::size_t{1} << (rng() % 22);
      n += rng() % n;
      if (rng() % 50 == 0) n = 16 * MiB + rng() % (8 * MiB);  // dedicated
      char* p = static_cast<char*>(alloc(a, n));
      std::memset(p, i & 0xFF, n);
      live.emplace_back(p, n);
      if (live.size() > 40) {
        auto k = rng() % live.size();
        for (std::size_t j = 0; j < live[k].second; j += 997)
          CHECK(static_cast<unsigned char>(live[k].first[j]) ==
                static_cast<unsigned char>(live[k].first[0]));
        CHECK_OK(a.release(live[k].first));
        live.erase(live.begin() + static_cast<long>(k));
      }
    }
    std::map<char*, std::size_t> spans(live.begin(), live.end());
    char* end = nullptr;
    for (auto& [p, n] : spans) {
      CHECK(p >= end);
      end = p + n;
    }
    check_invariants(a);
    CHECK(a.stats().fallback_allocations == 0);
    CHECK(a.stats().reuse_hits > 0);
    for (auto& [p, n] : live) CHECK_OK(a.release(p));
    CHECK(a.stats().bytes_in_use == 0);
    CHECK_OK(a.trim());
    CHECK(a.stats().bytes_pinned == 0 && a.stats().slabs == 0 && a.stats().dedicated_blocks == 0);
    check_invariants(a);
  }
  CHECK(fake::pins == fake::unpins && fake::errors == 0);
}

void test_dedicated() {
  fake::reset();
  HostArena a(fake::driver);
  void* p = alloc(a, 16 * MiB + 1);  // rounded to 2 MiB: 18 MiB
  HostMemoryStats s = a.stats();
  CHECK(s.dedicated_blocks == 1 && s.slabs == 0 && s.bytes_pinned == 18 * MiB);
  CHECK(s.bytes_in_use == 18 * MiB);
  CHECK_OK(a.release(p));
  void* q = alloc(a, 17 * MiB);  // fits the cached 18 MiB block
  CHECK(q == p && a.stats().pin_calls == 1 && a.stats().reuse_hits == 1);
  CHECK_OK(a.release(q));
  void* r = alloc(a, 30 * MiB);  // the 18 MiB block is too small: a new one
  CHECK(r != p && a.stats().pin_calls == 2);
  CHECK_OK(a.release(r));
  void* t = alloc(a, 17 * MiB);  // 18 MiB cached block is taken, not the 30 MiB one
  CHECK(t == p);
  CHECK_OK(a.release(t));
  void* u = alloc(a, 22 * MiB);  // 30 MiB > 22 * 1.25: not reused
  CHECK(u != r && a.stats().pin_calls == 3);
  CHECK_OK(a.release(u));
  check_invariants(a);
  CHECK_OK(a.trim());
  CHECK(a.stats().bytes_pinned == 0 && a.stats().unpin_calls == 3);
  check_invariants(a);
}

void test_pin_failure_and_no_driver() {
  fake::reset();
  {
    HostArena a(fake::driver);
    fake::fail_pin = true;
    bool pinned = true;
    void* p = alloc(a, 100, &pinned);
    CHECK(!pinned && a.stats().fallback_reason.find("fake cudaHostAlloc failure") != std::string::npos);
    fake::fail_pin = false;
    void* q = alloc(a, 100, &pinned);  // the next one tries again
    CHECK(pinned);
    CHECK_OK(a.release(p));
    CHECK_OK(a.release(q));
  }
  fake::reset();
  fake::available = false;
  HostArena a(fake::driver);
  bool pinned = true;
  void* p = alloc(a, 100, &pinned);
  CHECK(!pinned && a.stats().fallback_reason == "fake: no GPU" && !a.stats().pinning_available);
  char buf[8192];
  CHECK(a.register_memory(buf, sizeof buf).code() == StatusCode::kUnsupported);
  CHECK(a.unregister_memory(buf).code() == StatusCode::kUnsupported);
  void* dev = nullptr;
  CHECK(a.device_pointer(buf, &dev).code() == StatusCode::kUnsupported);
  CHECK_OK(a.release(p));
  CHECK(fake::pins == 0);
}

void test_register() {
  fake::reset();
  HostArena a(fake::driver);
  CHECK_OK(a.set_budget(3 * MiB));
  std::vector<char> buf(2 * MiB);
  CHECK(!a.is_pinned(buf.data()));
  CHECK_OK(a.register_memory(buf.data(), buf.size()));
  CHECK(a.is_pinned(buf.data()) && a.is_pinned(buf.data() + buf.size() - 1));
  CHECK(!a.is_pinned(buf.data() + buf.size()));
  CHECK(a.stats().bytes_registered == 2 * MiB);
  CHECK(a.register_memory(buf.data() + 100, 10).code() == StatusCode::kInvalidArgument);
  std::vector<char> other(2 * MiB);
  Status s = a.register_memory(other.data(), other.size());  // 2 + 2 > 3 MiB
  CHECK(s.code() == StatusCode::kOutOfMemory && s.message().find("budget") != std::string::npos);
  CHECK(a.register_memory(nullptr, 10).code() == StatusCode::kInvalidArgument);
  CHECK(a.register_memory(other.data(), 0).code() == StatusCode::kInvalidArgument);
  bool pinned = true;
  void* p = alloc(a, 2 * MiB, &pinned);  // registered memory counts against the budget
  CHECK(!pinned);
  CHECK_OK(a.release(p));
  void* dev = nullptr;
  CHECK_OK(a.device_pointer(buf.data(), &dev));
  CHECK(dev == buf.data());
  CHECK(a.unregister_memory(buf.data() + 1).code() == StatusCode::kInvalidArgument);
  CHECK_OK(a.unregister_memory(buf.data()));
  CHECK(a.stats().bytes_registered == 0 && !a.is_pinned(buf.data()));
  CHECK(a.unregister_memory(buf.data()).code() == StatusCode::kInvalidArgument);
  CHECK(fake::registered.empty() && fake::errors == 0);
}

void test_threads() {
  fake::reset();
  {
    HostArena a(fake::driver);
    CHECK_OK(a.set_budget(100 * MiB));  // tight: pinning, unpinning and fallback all happen
    std::atomic<int> bad{0};
    std::vector<std::thread> threads;
    const int kThreads = 6, kIters = 1500;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        std::mt19937 rng(100 + t);
        std::vector<std::pair<unsigned char*, std::size_t>> held;
        for (int i = 0; i < kIters; ++i) {
          std::size_t n = 1 + rng() % (rng() % 8 == 0 ? 24 * MiB : 300000);
          void* p = nullptr;
          if (!a.allocate(n, &p).is_ok() || p == nullptr) {
            ++bad;
            continue;
          }
          auto* c = static_cast<unsigned char*>(p);
          const unsigned char tag = static_cast<unsigned char>(t * 16 + (i & 15));
          c[0] = tag;
          c[n - 1] = tag;
          c[n / 2] = tag;
          held.emplace_back(c, n);
          if (held.size() > 4 || rng() % 3 == 0) {
            auto k = rng() % held.size();
            auto [q, m] = held[k];
            if (q[0] != q[m - 1] || q[0] != q[m / 2]) ++bad;
            if (!a.release(q).is_ok()) ++bad;
            held.erase(held.begin() + static_cast<long>(k));
          }
          if (rng() % 500 == 0) (void)a.trim();
          if (rng() % 200 == 0) (void)a.stats();
        }
        for (auto [q, m] : held) {
          if (q[0] != q[m - 1] || q[0] != q[m / 2]) ++bad;
          if (!a.release(q).is_ok()) ++bad;
        }
      });
    }
    for (auto& th : threads) th.join();
    CHECK(bad == 0);
    HostMemoryStats s = a.stats();
    CHECK(s.bytes_in_use == 0 && s.fallback_bytes_in_use == 0 && s.bytes_requested == 0);
    CHECK(s.allocations == std::uint64_t(kThreads) * kIters);
    CHECK(s.reuse_hits > 0 && s.pin_calls > 0);  // fallbacks depend on timing
    CHECK(s.bytes_pinned <= s.budget);
    std::printf("threads: pin_calls %llu unpin_calls %llu reuse_hits %llu fallbacks %llu\n",
                (unsigned long long)s.pin_calls, (unsigned long long)s.unpin_calls,
                (unsigned long long)s.reuse_hits, (unsigned long long)s.fallback_allocations);
    check_invariants(a);
    CHECK_OK(a.trim());
    CHECK(a.stats().bytes_pinned == 0);
  }
  CHECK(fake::pins == fake::unpins && fake::errors == 0);
}

}  // namespace

int main() {
  test_size_classes();
  test_parse();
  test_reuse();
  test_many_blocks_disjoint();
  test_dedicated();
  test_pin_failure_and_no_driver();
  test_register();
  test_threads();
  return report("test_host_memory");
}
