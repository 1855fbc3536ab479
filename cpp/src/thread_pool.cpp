// Persistent std::thread pool: tasks are claimed with one compare-and-swap each; idle workers spin
// briefly on the generation word, then sleep on a condition variable.
#include "ramstream/thread_pool.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <memory>

#if defined(__x86_64__) || defined(__i386__) || defined(_M_X64)
#include <immintrin.h>
#define RAMSTREAM_CPU_RELAX() _mm_pause()
#elif defined(__aarch64__)
#define RAMSTREAM_CPU_RELAX() asm volatile("yield" ::: "memory")
#else
#define RAMSTREAM_CPU_RELAX() std::this_thread::yield()
#endif

namespace ramstream {

namespace {

// 150 us: on the 2-core CI VM of 2026-12-02 a sleeping worker took ~50-100 us to wake, and with
// 50 us of spin a 1M-parameter AdamW step (0.4 ms) paid it on every call: 0.47 ms against 0.39 ms
// spinning 100-300 us (bench/RESULTS.md, fifth session). Idle workers yield while they spin.
constexpr std::int64_t kDefaultSpinNs = 150'000;
constexpr std::int64_t kMaxTasks = 0xFFFF;

std::uint32_t gen_of(std::uint64_t c) { return static_cast<std::uint32_t>(c >> 32); }
int tasks_of(std::uint64_t c) { return static_cast<int>((c >> 16) & 0xFFFF); }
int next_of(std::uint64_t c) { return static_cast<int>(c & 0xFFFF); }

std::int64_t spin_ns_from_env() {
  if (const char* env = std::getenv("RAMSTREAM_POOL_SPIN_US")) {
    char* end = nullptr;
    const long v = std::strtol(env, &end, 10);
    if (end != env && *end == '\0' && v >= 0 && v <= 1'000'000) return static_cast<std::int64_t>(v) * 1000;
  }
  return kDefaultSpinNs;
}

// Spins until done() or for about `ns` nanoseconds; returns done(). Yields the core every few
// microseconds: a thread just woken may be queued on this core (the scheduler likes to put a
// wakee next to its waker), and it may hold a task the spinner waits for.
template <typename Done>
bool spin_until(std::int64_t ns, Done done) {
  if (done()) return true;
  if (ns <= 0) return false;
  const auto limit = std::chrono::steady_clock::now() + std::chrono::nanoseconds(ns);
  for (;;) {
    for (int k = 0; k < 32; ++k) {
      RAMSTREAM_CPU_RELAX();
      if (done()) return true;
    }
    std::this_thread::yield();
    if (done()) return true;
    if (std::chrono::steady_clock::now() >= limit) return false;
  }
}

}  // namespace

ThreadPool::ThreadPool(int num_threads)
    : num_threads_(std::max(1, num_threads)), spin_ns_(spin_ns_from_env()) {
  // The caller is one of the threads: start num_threads_ - 1 workers.
  for (int i = 1; i < num_threads_; ++i) workers_.emplace_back([this] { worker_loop(); });
}

ThreadPool::~ThreadPool() {
  stop_.store(true);
  { std::lock_guard<std::mutex> lock(mutex_); }
  wake_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::run_tasks(std::uint32_t gen) {
  std::uint64_t c = claim_.load(std::memory_order_acquire);
  for (;;) {
    if (gen_of(c) != gen || next_of(c) >= tasks_of(c)) return;
    if (!claim_.compare_exchange_weak(c, c + 1, std::memory_order_acquire, std::memory_order_acquire))
      continue;  // c was reloaded
    // Claimed task next_of(c) of `gen`: the job stays as it is until pending_ drops to 0.
    const int t = next_of(c);
    (*job_)(bounds_[t], bounds_[t + 1]);
    if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      { std::lock_guard<std::mutex> lock(mutex_); }
      done_.notify_all();
    }
    c = claim_.load(std::memory_order_acquire);
  }
}

void ThreadPool::worker_loop() {
  std::uint32_t seen = gen_of(claim_.load());
  for (;;) {
    const auto fresh = [&] { return stop_.load() || gen_of(claim_.load()) != seen; };
    if (!spin_until(spin_ns_, fresh)) {
      std::unique_lock<std::mutex> lock(mutex_);
      sleepers_.fetch_add(1);
      wake_.wait(lock, fresh);
      sleepers_.fetch_sub(1);
    }
    if (stop_.load()) return;
    seen = gen_of(claim_.load());
    run_tasks(seen);
  }
}

void ThreadPool::parallel_for(std::int64_t n, std::int64_t granule, std::int64_t min_per_task,
                              const std::function<void(std::int64_t, std::int64_t)>& fn,
                              int max_tasks) {
  if (n <= 0) return;
  granule = std::max<std::int64_t>(1, granule);
  min_per_task = std::max<std::int64_t>(granule, min_per_task);
  std::int64_t tasks = max_tasks > 0 ? max_tasks : num_threads_;
  tasks = std::min<std::int64_t>({tasks, kMaxTasks, std::max<std::int64_t>(1, n / min_per_task)});
  if (tasks <= 1 || num_threads_ == 1) {
    fn(0, n);
    return;
  }
  // Equal shares rounded up to the granule; the last range takes the remainder.
  const std::int64_t units = (n + granule - 1) / granule;
  const std::int64_t per = (units + tasks - 1) / tasks;
  std::lock_guard<std::mutex> call_lock(call_mutex_);
  bounds_.clear();
  for (std::int64_t b = 0; b < n; b += per * granule) bounds_.push_back(b);
  bounds_.push_back(n);
  const int ntasks = static_cast<int>(bounds_.size()) - 1;
  job_ = &fn;
  pending_.store(ntasks, std::memory_order_relaxed);
  const std::uint32_t gen = gen_of(claim_.load()) + 1;
  // Publishes job_, bounds_ and pending_ (release) with the new generation; seq_cst so that the
  // sleepers_ check below cannot miss a worker that is about to block.
  claim_.store((static_cast<std::uint64_t>(gen) << 32) | (static_cast<std::uint64_t>(ntasks) << 16));
  if (sleepers_.load() > 0) {
    { std::lock_guard<std::mutex> lock(mutex_); }
    wake_.notify_all();
  }
  run_tasks(gen);  // the caller works too
  const auto finished = [&] { return pending_.load(std::memory_order_acquire) == 0; };
  if (!spin_until(spin_ns_, finished)) {
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, finished);
  }
  job_ = nullptr;
}

int default_num_threads() {
  if (const char* env = std::getenv("RAMSTREAM_NUM_THREADS")) {
    char* end = nullptr;
    long v = std::strtol(env, &end, 10);
    if (end != env && *end == '\0' && v > 0 && v <= 4096) return static_cast<int>(v);
  }
  unsigned hc = std::thread::hardware_concurrency();
  return hc == 0 ? 1 : static_cast<int>(hc);
}

namespace {
std::mutex g_pool_mutex;
std::unique_ptr<ThreadPool> g_pool;
}  // namespace

ThreadPool& global_pool() {
  std::lock_guard<std::mutex> lock(g_pool_mutex);
  if (!g_pool) g_pool = std::make_unique<ThreadPool>(default_num_threads());
  return *g_pool;
}

void set_global_pool_size(int n) {
  std::lock_guard<std::mutex> lock(g_pool_mutex);
  g_pool = std::make_unique<ThreadPool>(n > 0 ? n : default_num_threads());
}

}  // namespace ramstream
