// Persistent std::thread pool: workers sleep on a condition variable and claim tasks by index.
#include "ramstream/thread_pool.h"

#include <algorithm>
#include <cstdlib>
#include <memory>

namespace ramstream {

ThreadPool::ThreadPool(int num_threads) : num_threads_(std::max(1, num_threads)) {
  // The caller is one of the threads: start num_threads_ - 1 workers.
  for (int i = 1; i < num_threads_; ++i) workers_.emplace_back([this, i] { worker_loop(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::worker_loop(int /*index*/) {
  std::uint64_t seen = 0;
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
    if (stop_) return;
    seen = generation_;
    while (next_task_ < tasks_) {
      const int t = next_task_++;
      const auto* fn = job_;
      const std::int64_t b = bounds_[t], e = bounds_[t + 1];
      lock.unlock();
      (*fn)(b, e);
      lock.lock();
      if (--pending_ == 0) done_.notify_all();
    }
  }
}

void ThreadPool::parallel_for(std::int64_t n, std::int64_t granule, std::int64_t min_per_task,
                              const std::function<void(std::int64_t, std::int64_t)>& fn,
                              int max_tasks) {
  if (n <= 0) return;
  granule = std::max<std::int64_t>(1, granule);
  min_per_task = std::max<std::int64_t>(granule, min_per_task);
  std::int64_t tasks = max_tasks > 0 ? max_tasks : num_threads_;
  tasks = std::min<std::int64_t>(tasks, std::max<std::int64_t>(1, n / min_per_task));
  if (tasks <= 1 || num_threads_ == 1) {
    fn(0, n);
    return;
  }
  // Equal shares rounded up to the granule; the last range takes the remainder.
  const std::int64_t units = (n + granule - 1) / granule;
  const std::int64_t per = (units + tasks - 1) / tasks;
  std::lock_guard<std::mutex> call_lock(call_mutex_);
  std::unique_lock<std::mutex> lock(mutex_);
  bounds_.clear();
  for (std::int64_t b = 0; b < n; b += per * granule) bounds_.push_back(b);
  bounds_.push_back(n);
  job_ = &fn;
  tasks_ = static_cast<int>(bounds_.size()) - 1;
  next_task_ = 0;
  pending_ = tasks_;
  ++generation_;
  wake_.notify_all();
  while (next_task_ < tasks_) {  // the caller works too
    const int t = next_task_++;
    const std::int64_t b = bounds_[t], e = bounds_[t + 1];
    lock.unlock();
    fn(b, e);
    lock.lock();
    --pending_;
  }
  done_.wait(lock, [&] { return pending_ == 0; });
  job_ = nullptr;
  tasks_ = 0;
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
