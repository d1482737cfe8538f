// Fixed-size thread pool behind parallel_for (see thread_pool.h).
#include "core/thread_pool.h"

#include <algorithm>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace opd {
namespace {

thread_local bool t_inside_pool = false;

class ThreadPool {
 public:
  explicit ThreadPool(int n) {
    for (int i = 0; i < n - 1; ++i) workers_.emplace_back([this] { worker(); });
  }
  ~ThreadPool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
  }
  int size() const { return static_cast<int>(workers_.size()) + 1; }

  void run(int64_t n, int64_t chunk, const std::function<void(int64_t, int64_t)>& fn) {
    std::lock_guard<std::mutex> run_lock(run_mu_);  // one parallel_for at a time
    {
      std::lock_guard<std::mutex> lock(mu_);
      fn_ = &fn;
      n_ = n;
      chunk_ = chunk;
      next_ = 0;
      pending_ = static_cast<int>(workers_.size());
      error_ = nullptr;
      ++generation_;
    }
    cv_.notify_all();
    work();  // the caller helps
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [this] { return pending_ == 0; });
    fn_ = nullptr;
    if (error_) std::rethrow_exception(error_);
  }

 private:
  void work() {
    t_inside_pool = true;
    for (;;) {
      int64_t begin;
      {
        std::lock_guard<std::mutex> lock(mu_);
        begin = next_;
        next_ += chunk_;
      }
      if (begin >= n_) break;
      int64_t end = std::min(n_, begin + chunk_);
      try {
        (*fn_)(begin, end);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu_);
        if (!error_) error_ = std::current_exception();
      }
    }
    t_inside_pool = false;
  }
  void worker() {
    uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
      }
      work();
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (--pending_ == 0) done_cv_.notify_all();
      }
    }
  }

  std::vector<std::thread> workers_;
  std::mutex run_mu_, mu_;
  std::condition_variable cv_, done_cv_;
  const std::function<void(int64_t, int64_t)>* fn_ = nullptr;
  int64_t n_ = 0, chunk_ = 1, next_ = 0;
  int pending_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
};

int default_threads() {
  if (const char* env = std::getenv("OPD_NUM_THREADS")) {
    int n = std::atoi(env);
    if (n > 0) return n;
  }
  return std::max(1u, std::thread::hardware_concurrency());
}

std::mutex g_pool_mu;
std::unique_ptr<ThreadPool> g_pool;
int g_threads = 0;

ThreadPool& pool() {
  std::lock_guard<std::mutex> lock(g_pool_mu);
  if (!g_pool) {
    if (g_threads <= 0) g_threads = default_threads();
    g_pool = std::make_unique<ThreadPool>(g_threads);
  }
  return *g_pool;
}

}  // namespace

int num_threads() { return pool().size(); }

void set_num_threads(int n) {
  std::lock_guard<std::mutex> lock(g_pool_mu);
  g_pool.reset();
  g_threads = n;
}

void parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn, int64_t min_chunk) {
  if (n <= 0) return;
  ThreadPool& p = pool();
  int64_t chunk = std::max<int64_t>(min_chunk, (n + p.size() * 4 - 1) / (p.size() * 4));
  if (t_inside_pool || p.size() == 1 || n <= chunk) {
    fn(0, n);
    return;
  }
  p.run(n, chunk, fn);
}

}  // namespace opd
