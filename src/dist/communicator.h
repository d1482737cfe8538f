// The collectives data-parallel training needs, behind one interface with two backends:
// - NCCL (nccl_communicator.cpp, CUDA builds with nccl.h): device tensors, issued on the calling
//   thread's current stream (cuda::current_stream(); set it with cuda::StreamScope), asynchronous,
//   with a watchdog that aborts the communicator (ncclCommAbort) when a collective does not finish
//   within the timeout, so a dead or hung peer becomes an error instead of a hang;
// - CPU (cpu_communicator.cpp): host tensors, over the TCP store (gloo-like), synchronous;
//   for tests, CPU runs and the CPU reference of the NCCL results.
// Semantics follow NCCL: all_reduce in place; reduce_scatter reads world*n elements and writes
// this rank's n = rank-th block of the reduction; all_gather reads n and writes world*n (rank r's
// block at r*n; `in` may be that block of `out`, in place); broadcast in place from root.
// Reductions accumulate in f32 (bf16 inputs are widened, the result rounded once). The CPU
// backend sums in rank order 0..world-1, so every rank gets bitwise the same result; Avg is the
// sum divided by the world size.
#pragma once

#include <memory>
#include <string>

#include "core/tensor.h"
#include "dist/tcp_store.h"

namespace opd::dist {

enum class ReduceOp { Sum, Avg };
const char* reduce_op_name(ReduceOp op);

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual const char* backend() const = 0;  // "nccl" | "cpu"
  virtual Device device() const = 0;        // where its tensors live
  int rank() const { return store_->rank(); }
  int world_size() const { return store_->world_size(); }
  // The host-side channel (barriers, small host all-reduces, "did any rank fail").
  Store& store() { return *store_; }

  virtual void all_reduce(Tensor& t, ReduceOp op) = 0;
  virtual void reduce_scatter(const Tensor& in, Tensor& out, ReduceOp op) = 0;
  virtual void all_gather(const Tensor& in, Tensor& out) = 0;
  virtual void broadcast(Tensor& t, int root) = 0;
  // Waits until every collective issued so far has finished. NCCL: throws Cuda when the
  // watchdog aborted the communicator (naming the collective, the rank and the timeout) or NCCL
  // reported an asynchronous error; after that every call throws. CPU: nothing to wait for.
  virtual void synchronize() = 0;

 protected:
  explicit Communicator(std::shared_ptr<Store> store) : store_(std::move(store)) {}
  // Shape/dtype/device checks shared by both backends (InvalidArgument naming the call).
  void check_tensor(const char* call, const char* name, const Tensor& t) const;
  std::shared_ptr<Store> store_;
};

std::unique_ptr<Communicator> make_cpu_communicator(std::shared_ptr<Store> store);

// NCCL on CUDA device `device` (made current on the calling thread). Rank 0 creates the unique
// id and broadcasts it through the store; the set-up itself is non-blocking and bounded by
// timeout_s (a rank that never joins is an error naming the timeout). libnccl.so.2 is loaded at
// run time (see nccl_library_candidates()). Throws Unsupported in builds without CUDA or nccl.h
// and when the library cannot be loaded.
std::unique_ptr<Communicator> make_nccl_communicator(std::shared_ptr<Store> store, int device,
                                                     double timeout_s);
// Whether make_nccl_communicator can work here; when not, *why says what is missing.
bool nccl_available(std::string* why = nullptr);

}  // namespace opd::dist
