// A persistent pool of std::threads with a blocking parallel_for. The calling thread takes part.
// Sized by RAMSTREAM_NUM_THREADS (default: all cores). parallel_for is thread-safe: concurrent
// callers are served one after another.
#pragma once
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace ramstream {

class ThreadPool {
 public:
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return num_threads_; }

  // Splits [0, n) into at most `max_tasks` (<= 0: size()) contiguous ranges whose boundaries are
  // multiples of `granule`, and runs fn(begin, end) on them in parallel. Ranges below
  // `min_per_task` items are merged, so small n runs inline on the caller.
  void parallel_for(std::int64_t n, std::int64_t granule, std::int64_t min_per_task,
                    const std::function<void(std::int64_t, std::int64_t)>& fn,
                    int max_tasks = 0);

 private:
  void worker_loop(int index);

  int num_threads_;
  std::vector<std::thread> workers_;
  std::mutex call_mutex_;  // serialises parallel_for callers
  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable done_;
  const std::function<void(std::int64_t, std::int64_t)>* job_ = nullptr;
  std::vector<std::int64_t> bounds_;
  int tasks_ = 0;
  int next_task_ = 0;
  int pending_ = 0;
  std::uint64_t generation_ = 0;
  bool stop_ = false;
};

// The process-wide pool (created on first use).
ThreadPool& global_pool();
// Replaces the process-wide pool with one of n threads (n <= 0: all cores). Not thread-safe with
// respect to running parallel_for calls: call it while the pool is idle.
void set_global_pool_size(int n);
// Threads RAMSTREAM_NUM_THREADS asks for, or the number of cores.
int default_num_threads();

}  // namespace ramstream
