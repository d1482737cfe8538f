// ZeRO-1/2 data parallelism (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training
// Trillion Parameter Models", SC 2020): the f32 master weights, AdamW moments and the reduced
// gradients are split across ranks; each rank updates only its shard and the updated model
// copy (bf16 or f32) is all-gathered back to every rank.
//
// Flat layout (make_shard_layout): parameters are laid out in order in one flat buffer, each
// starting at a multiple of `align` elements (so per-parameter views keep the 16-byte alignment
// vectorized kernels need), grouped into buckets of about bucket_numel elements (a parameter
// never spans buckets); each bucket is padded to a multiple of world * align and split into
// world equal shards: rank r owns [offset + r*S_b, offset + (r+1)*S_b) of bucket b. A rank's
// shard buffer is the concatenation of its slices of every bucket, one AdamW parameter each
// (src/train/optimizer.h). Padding is zero in weights and gradients and stays zero under AdamW.
//
// One step:  grad_local (f32, full, what the backward accumulates into)
//   --reduce_scatter(sum|avg) per bucket-->  grad_shard (+= over micro-batches for ZeRO-2)
//   --global norm: host all-reduce of per-shard sums of squares, clip coefficient as
//     torch.nn.utils.clip_grad_norm_, shard gradient scaled in place-->
//   AdamW on the shard (master, m, v, and the shard's slice of the model copy)
//   --all_gather per bucket (in place)--> model (full, replicated).
// ZeRO-1: step() reduce-scatters every bucket (after the last micro-batch). ZeRO-2: the caller
// calls reduce_bucket(b) as soon as the backward of a micro-batch has finished bucket b (or
// reduce_all() after it), overlapping communication with the remaining backward; step() then
// reduces nothing. On CUDA the reductions run on a communication stream of their own: an event
// recorded on the compute stream at reduce_bucket() orders them after the backward kernels that
// produced the bucket, and wait_reductions() (an event the other way) orders the next use of the
// gradient memory after them. Deterministic: with the CPU backend the result equals a single-process AdamW
// on the rank-ordered sum of the gradients except for the f64 summation order of the norm.
// Memory per rank: model P x sizeof(model dtype) + grad_local 4P + (master, m, v, grad shard,
// one bucket scratch) 16P/world + 4 bucket_numel/world.
#pragma once

#include <memory>
#include <vector>

#include "core/tensor.h"
#include "dist/communicator.h"
#include "train/optimizer.h"

namespace opd::dist {

enum class ZeroStage { One = 1, Two = 2 };

struct ShardLayout {
  struct Param {
    Shape shape;
    int64_t numel = 0;
    int64_t offset = 0;  // in the flat buffer
    int bucket = 0;
  };
  struct Bucket {
    int64_t offset = 0;        // in the flat buffer
    int64_t numel = 0;         // padded: world * shard_numel
    int64_t shard_numel = 0;   // S_b
    int64_t shard_offset = 0;  // of this bucket's slice in a rank's shard buffer
    size_t first_param = 0, end_param = 0;
  };
  int world_size = 1;
  int64_t align = 64;
  int64_t bucket_numel = 0;  // the target bucket size it was made with (recorded in checkpoints)
  std::vector<Param> params;
  std::vector<Bucket> buckets;
  int64_t total_numel = 0;  // flat buffer length
  int64_t shard_numel = 0;  // one rank's shard buffer length (sum of S_b)
  // First flat element of `rank`'s slice of bucket b.
  int64_t shard_begin(int b, int rank) const { return buckets[b].offset + rank * buckets[b].shard_numel; }
};

// Throws InvalidArgument on world_size < 1, bucket_numel < 1, align < 1 or a negative dim.
ShardLayout make_shard_layout(const std::vector<Shape>& shapes, int world_size,
                              int64_t bucket_numel = int64_t{1} << 24, int64_t align = 64);

struct ZeroConfig {
  ZeroStage stage = ZeroStage::One;
  // Sum when the loss is already normalized over every rank's tokens (opd's loss is the mean
  // over the tokens of the whole optimizer step), Avg when each rank normalized its own.
  ReduceOp grad_reduce = ReduceOp::Sum;
  DType model_dtype = DType::BF16;
  AdamWConfig adamw;
  int64_t bucket_numel = int64_t{1} << 24;
  int64_t align = 64;
};

class ZeroOptimizer {
 public:
  // Buffers live on comm.device(). Weights start at zero: call load_weights() next.
  ZeroOptimizer(Communicator& comm, const std::vector<Shape>& shapes, ZeroConfig config);
  ~ZeroOptimizer();

  const ShardLayout& layout() const { return layout_; }
  const ZeroConfig& config() const { return config_; }
  Communicator& comm() const { return comm_; }
  // Parameter i of the replicated model copy (model_dtype), a view into the flat buffer:
  // forward passes read it, step() rewrites it.
  Tensor param(size_t i) const;
  // Parameter i's f32 local gradient (a view): the backward accumulates into it.
  Tensor grad(size_t i) const;
  Tensor model_flat() const { return model_; }
  Tensor grad_flat() const { return grad_local_; }

  // Every rank passes the same full f32 (or bf16) weights, shaped like the parameters, on any
  // device: this rank keeps its master shard and the full model copy.
  void load_weights(const std::vector<Tensor>& weights);

  // Reduce-scatters bucket b's local gradient into this rank's gradient shard (+=) and clears
  // the local bucket. Every rank must reduce the same buckets in the same order.
  // CUDA: asynchronous on a communication stream of its own, ordered after the work queued so
  // far on the current (compute) stream by an event, so the backward of later layers overlaps it
  // (ZeRO-2). The gradient memory is the communication stream's until wait_reductions().
  void reduce_bucket(int b);
  void reduce_all();
  // Makes the current stream wait for every reduction issued so far (an event; the host does not
  // block). Call it before the next write into the local gradients (the next micro-batch's loss
  // and backward); step(), grad_norm(), zero_grad() and the state functions call it themselves.
  // No-op on the CPU backend, where reductions are synchronous.
  void wait_reductions();
  // Clears the local gradients and the gradient shard (e.g. after a skipped step).
  void zero_grad();

  // ZeRO-1: reduce_all() first. Then global-norm clipping (max_norm > 0), AdamW on the shard,
  // all-gather of the model copy; gradients are left zero. The report's norm is global.
  StepReport step(double lr, double max_norm = 0);
  // The same, but first the global gradient norm (all-reduced, so every rank decides alike): when
  // it is not finite the gradients are cleared, nothing is updated and false is returned (a
  // skipped step). *report gets the norm either way. One norm computation per step.
  bool step_if_finite(double lr, double max_norm, StepReport* report);
  // The global gradient norm of the reduced shards (no update; host all-reduce).
  double grad_norm();
  int64_t steps() const;

  // Unsharded optimizer state, gathered on every rank (host f32 tensors shaped like the
  // parameters): for checkpoints, which can then be loaded on any number of ranks.
  struct FullState {
    std::vector<Tensor> master, exp_avg, exp_avg_sq;
    int64_t steps = 0;
  };
  FullState gather_state();
  // Loads a FullState (from any world size); refreshes the model copy from the master.
  void load_state(const FullState& state);

  // This rank's shard of the optimizer state: 1-D host f32 vectors of layout().shard_numel
  // elements each (the shard buffers above, padding included), for sharded checkpoints
  // (memory: 12P/world). On the CPU backend `master` aliases the live buffer: write it out
  // before the next step.
  struct ShardState {
    Tensor master, exp_avg, exp_avg_sq;
    int64_t steps = 0;
  };
  ShardState shard_state();
  // Loads this rank's shard (1-D f32 vectors of shard_numel elements on any device, e.g. built
  // by dist/reshard.h from a checkpoint of another world size); the model copy is rebuilt from
  // the master shards by an all-gather (collective: every rank calls it). Gradients are cleared.
  void load_shard_state(const ShardState& state);
  // The full f32 master weights of bucket b (an all-gather of its master shards: collective),
  // copied to the host when want_host (else an undefined tensor is returned). Memory: one bucket.
  // For writing the model export bucket by bucket.
  Tensor gather_master_bucket(int b, bool want_host);

 private:
  double local_sum_squares();
  void apply(double lr, double max_norm, StepReport& report);  // clip, AdamW, all-gather
  Tensor shard_view(const Tensor& shard_buffer, int b) const;
  Tensor flat_to_host_full(const std::vector<Tensor>& per_param, const char* what) const;
  void scatter_full_into_shard(const Tensor& host_full, Tensor& shard) const;
  void gather_model();
  void model_from_master();  // this rank's slice of the model copy := master shard, all-gathered
  void reduce_bucket_now(int b);  // the reduction, on the current stream

  Communicator& comm_;
  ZeroConfig config_;
  ShardLayout layout_;
  Device device_;
  Tensor model_, grad_local_;              // full, replicated / local
  Tensor master_, grad_shard_, scratch_;   // this rank's shard; scratch: one bucket's shard
  std::unique_ptr<AdamW> adamw_;
  struct CommStream;  // CUDA: the communication stream and its events (zero.cpp)
  std::unique_ptr<CommStream> comm_stream_;
};

}  // namespace opd::dist
