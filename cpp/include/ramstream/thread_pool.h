// A persistent pool of std::threads with a blocking parallel_for. The calling thread takes part.
// Sized by RAMSTREAM_NUM_THREADS (default: all cores). parallel_for is thread-safe: concurrent
// callers are served one after another.
#pragma once
#include <atomic>
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

  // Splits [0, n) into at most `max_tasks` (<= 0: size(); at most 65535) contiguous ranges whose
  // boundaries are multiples of `granule`, and runs fn(begin, end) on them in parallel; threads
  // claim ranges one at a time. Ranges below `min_per_task` items are merged, so small n runs
  // inline on the caller. After a call, workers spin for a short while (RAMSTREAM_POOL_SPIN_US,
  // default 150 microseconds; 0: never) before they sleep, so that back-to-back calls do not pay
  // for waking them.
  void parallel_for(std::int64_t n, std::int64_t granule, std::int64_t min_per_task,
                    const std::function<void(std::int64_t, std::int64_t)>& fn,
                    int max_tasks = 0);

 private:
  void worker_loop();
  // Claims and runs tasks of generation `gen` until none is left; false once gen is over.
  void run_tasks(std::uint32_t gen);

  int num_threads_;
  std::int64_t spin_ns_;
  std::vector<std::thread> workers_;
  std::mutex call_mutex_;  // serialises parallel_for callers
  // The job of the current generation: written by the caller before it publishes the generation
  // in claim_, stable until every task of it has finished.
  const std::function<void(std::int64_t, std::int64_t)>* job_ = nullptr;
  std::vector<std::int64_t> bounds_;
  // (generation << 32) | (tasks << 16) | next task to claim: one word, so that a thread can claim a
  // task of the generation it saw and of no other.
  std::atomic<std::uint64_t> claim_{0};
  std::atomic<int> pending_{0};   // tasks of the current generation not finished yet
  std::atomic<int> sleepers_{0};  // workers blocked (or about to block) on wake_
  std::atomic<bool> stop_{false};
  std::mutex mutex_;              // for the condition variables only
  std::condition_variable wake_;  // a new generation (or stop)
  std::condition_variable done_;  // pending_ reached 0
};

// The process-wide pool (created on first use).
ThreadPool& global_pool();
// Replaces the process-wide pool with one of n threads (n <= 0: all cores). Not thread-safe with
// respect to running parallel_for calls: call it while the pool is idle.
void set_global_pool_size(int n);
// Threads RAMSTREAM_NUM_THREADS asks for, or the number of cores.
int default_num_threads();

}  // namespace ramstream
