// Unit tests of the thread pool (ctest): every range covered exactly once with granule-aligned
// boundaries, concurrent callers, back-to-back calls with and without spinning, pools created and
// destroyed while workers spin or sleep.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

#include "ramstream/thread_pool.h"

using namespace ramstream;

namespace {

int g_failures = 0;
#define CHECK(cond)                                                               \
  do {                                                                            \
    if (!(cond)) {                                                                \
      std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      ++g_failures;                                                               \
    }                                                                             \
  } while (0)

// One parallel_for over n items: each index visited once, ranges start at granule multiples.
bool covers_once(ThreadPool& pool, std::int64_t n, std::int64_t granule, std::int64_t min_per_task,
                 int max_tasks) {
  std::vector<std::atomic<int>> hits(static_cast<std::size_t>(n));
  for (auto& h : hits) h.store(0);
  std::atomic<bool> aligned{true};
  pool.parallel_for(n, granule, min_per_task, [&](std::int64_t b, std::int64_t e) {
    if (b % granule != 0 || b >= e) aligned = false;
    for (std::int64_t i = b; i < e; ++i) hits[static_cast<std::size_t>(i)].fetch_add(1);
  }, max_tasks);
  for (auto& h : hits)
    if (h.load() != 1) return false;
  return aligned.load();
}

void test_coverage(int threads) {
  ThreadPool pool(threads);
  CHECK(pool.size() == threads);
  for (std::int64_t n : {1, 15, 16, 17, 1000, 4099, 65536 + 5}) {
    for (int tasks : {0, 1, 3, 4 * threads, 100}) {
      CHECK(covers_once(pool, n, 16, 16, tasks));
      CHECK(covers_once(pool, n, 1, 1, tasks));
    }
  }
  bool ran = false;
  pool.parallel_for(0, 16, 16, [&](std::int64_t, std::int64_t) { ran = true; });
  CHECK(!ran);
}

// Many small calls in a row (the engine's pattern), each checked.
void test_back_to_back(int threads, int calls) {
  ThreadPool pool(threads);
  std::vector<std::int64_t> data(4096);
  for (int c = 0; c < calls; ++c) {
    std::atomic<std::int64_t> sum{0};
    pool.parallel_for(static_cast<std::int64_t>(data.size()), 16, 16, [&](std::int64_t b, std::int64_t e) {
      std::int64_t s = 0;
      for (std::int64_t i = b; i < e; ++i) s += i + c;
      sum.fetch_add(s);
    }, 4 * threads);
    const std::int64_t n = static_cast<std::int64_t>(data.size());
    if (sum.load() != n * (n - 1) / 2 + n * c) {
      CHECK(false);
      return;
    }
  }
}

// Several threads share one pool: calls are serialised, each sees all of its own ranges.
void test_concurrent_callers(int threads) {
  ThreadPool pool(threads);
  std::atomic<int> bad{0};
  std::vector<std::thread> callers;
  for (int t = 0; t < 4; ++t) {
    callers.emplace_back([&, t] {
      for (int c = 0; c < 300; ++c)
        if (!covers_once(pool, 1000 + 16 * t + c % 7, 16, 16, 8)) bad.fetch_add(1);
    });
  }
  for (auto& th : callers) th.join();
  CHECK(bad.load() == 0);
}

// Pools destroyed right after a call (workers spinning) and after they went to sleep.
void test_destroy() {
  for (int k = 0; k < 50; ++k) {
    ThreadPool pool(3);
    CHECK(covers_once(pool, 512, 16, 16, 12));
  }
  ThreadPool pool(3);
  CHECK(covers_once(pool, 512, 16, 16, 12));
  std::this_thread::sleep_for(std::chrono::milliseconds(5));  // past the spin: workers asleep
  CHECK(covers_once(pool, 512, 16, 16, 12));
  std::this_thread::sleep_for(std::chrono::milliseconds(5));
}

}  // namespace

int main() {
  for (int spin : {0, 1}) {
    // the spin time is read when a pool is created
    setenv("RAMSTREAM_POOL_SPIN_US", spin ? "50" : "0", 1);
    for (int threads : {1, 2, 3, 5}) test_coverage(threads);
    test_back_to_back(3, 3000);
    test_concurrent_callers(3);
    test_destroy();
  }
  if (g_failures) {
    std::fprintf(stderr, "%d check(s) failed\n", g_failures);
    return 1;
  }
  std::printf("thread pool: all checks passed\n");
  return 0;
}
