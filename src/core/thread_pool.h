// A small fixed thread pool with a blocking parallel_for, used by CPU kernels to split
// independent work (attention heads, rows). Deterministic: each index runs exactly once and
// results never depend on which thread ran it. Nested calls run inline.
#pragma once

#include <cstdint>
#include <functional>

namespace opd {

// Number of worker threads (OPD_NUM_THREADS, else hardware concurrency).
int num_threads();
void set_num_threads(int n);

// Calls fn(begin, end) over disjoint chunks covering [0, n); returns when all are done.
// Exceptions thrown by fn are rethrown (the first one) in the caller.
void parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn,
                  int64_t min_chunk = 1);

}  // namespace opd
