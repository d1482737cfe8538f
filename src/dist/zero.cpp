// ZeRO-1/2 sharding (zero.h): the flat bucket layout, the reduce-scatter of gradients into the
// owner's shard, global-norm clipping across shards, AdamW (train/optimizer.h) on the shard
// views, and the all-gather of the updated model copy. Same code for the CPU and NCCL
// communicators: every device op is issued on the current stream, in order.
#include "dist/zero.h"

#include <algorithm>
#include <cmath>

#include "kernels/ops.h"  // add_inplace (shard gradient accumulation)
#ifdef OPD_WITH_CUDA
#include "core/cuda/allocator.h"  // cuda::current_stream, StreamScope
#include "core/cuda/stream.h"     // Stream, Event (the communication stream of reduce_bucket)
#include "dist/zero_cuda.h"
#endif

namespace opd::dist {

namespace {

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// torch.nn.utils.clip_grad_norm_: coef = max_norm / (norm + 1e-6) in f32, at most 1 (the same
// expression as train/optimizer.cpp, so a sharded step scales by the same f32 value).
float clip_coefficient(double norm, double max_norm) {
  const float c = static_cast<float>(max_norm) / (static_cast<float>(norm) + 1e-6f);
  return std::fmin(c, 1.0f);
}

}  // namespace

ShardLayout make_shard_layout(const std::vector<Shape>& shapes, int world_size,
                              int64_t bucket_numel, int64_t align) {
  OPD_CHECK(world_size >= 1, InvalidArgument, "shard layout: world size ", world_size, " < 1");
  OPD_CHECK(bucket_numel >= 1, InvalidArgument, "shard layout: bucket size ", bucket_numel, " < 1");
  OPD_CHECK(align >= 1, InvalidArgument, "shard layout: alignment ", align, " < 1");
  ShardLayout L;
  L.world_size = world_size;
  L.align = align;
  L.bucket_numel = bucket_numel;
  const int64_t unit = world_size * align;
  ShardLayout::Bucket cur;
  int64_t used = 0;  // elements of the open bucket, aligned starts included
  auto close_bucket = [&] {
    cur.numel = std::max(round_up(used, unit), unit);
    cur.shard_numel = cur.numel / world_size;
    cur.shard_offset = L.shard_numel;
    cur.end_param = L.params.size();
    L.shard_numel += cur.shard_numel;
    L.buckets.push_back(cur);
    ShardLayout::Bucket next;
    next.offset = cur.offset + cur.numel;
    next.first_param = L.params.size();
    cur = next;
    used = 0;
  };
  for (size_t i = 0; i < shapes.size(); ++i) {
    for (int64_t d : shapes[i])
      OPD_CHECK(d >= 0, InvalidArgument, "shard layout: parameter ", i, " has shape ",
                shape_str(shapes[i]));
    const int64_t n = shape_numel(shapes[i]);
    const int64_t start = round_up(used, align);
    if (cur.first_param < L.params.size() && start + n > bucket_numel) close_bucket();
    ShardLayout::Param p;
    p.shape = shapes[i];
    p.numel = n;
    p.offset = cur.offset + round_up(used, align);
    p.bucket = static_cast<int>(L.buckets.size());
    used = p.offset - cur.offset + n;
    L.params.push_back(p);
  }
  if (!L.params.empty()) close_bucket();
  L.total_numel = L.buckets.empty() ? 0 : L.buckets.back().offset + L.buckets.back().numel;
  return L;
}

ZeroOptimizer::ZeroOptimizer(Communicator& comm, const std::vector<Shape>& shapes,
                             ZeroConfig config)
    : comm_(comm), config_(config), device_(comm.device()) {
  OPD_CHECK(config_.model_dtype == DType::BF16 || config_.model_dtype == DType::F32,
            InvalidArgument, "ZeRO: the model copy must be bf16 or f32, got ",
            dtype_name(config_.model_dtype));
  OPD_CHECK(!shapes.empty(), InvalidArgument, "ZeRO: no parameters");
  layout_ = make_shard_layout(shapes, comm.world_size(), config_.bucket_numel, config_.align);
  int64_t max_shard = 0;
  for (const auto& b : layout_.buckets) max_shard = std::max(max_shard, b.shard_numel);
  model_ = Tensor::zeros({layout_.total_numel}, config_.model_dtype, device_);
  grad_local_ = Tensor::zeros({layout_.total_numel}, DType::F32, device_);
  master_ = Tensor::zeros({layout_.shard_numel}, DType::F32, device_);
  grad_shard_ = Tensor::zeros({layout_.shard_numel}, DType::F32, device_);
  scratch_ = Tensor::zeros({max_shard}, DType::F32, device_);
  std::vector<OptimParam> params;
  for (size_t b = 0; b < layout_.buckets.size(); ++b) {
    const auto& bk = layout_.buckets[b];
    const int64_t begin = layout_.shard_begin(static_cast<int>(b), comm.rank());
    params.push_back({shard_view(master_, static_cast<int>(b)),
                      shard_view(grad_shard_, static_cast<int>(b)),
                      model_.slice_rows(begin, begin + bk.shard_numel)});
  }
  adamw_ = std::make_unique<AdamW>(std::move(params), config_.adamw);
}

#ifdef OPD_WITH_CUDA
struct ZeroOptimizer::CommStream {
  ::opd::cuda::Stream stream;
  ::opd::cuda::Event compute_done;  // on the compute stream: the bucket's gradients are final
  ::opd::cuda::Event comm_done;     // on `stream`, after the latest reduction
  bool pending = false;             // reductions issued since the last wait_reductions()
};
#else
struct ZeroOptimizer::CommStream {};
#endif

ZeroOptimizer::~ZeroOptimizer() {
#ifdef OPD_WITH_CUDA
  // Queued reductions still use the buffers released below.
  if (comm_stream_ && comm_stream_->pending) (void)cudaStreamSynchronize(comm_stream_->stream.get());
#endif
}

Tensor ZeroOptimizer::shard_view(const Tensor& buf, int b) const {
  const auto& bk = layout_.buckets[b];
  return buf.slice_rows(bk.shard_offset, bk.shard_offset + bk.shard_numel);
}

Tensor ZeroOptimizer::param(size_t i) const {
  OPD_CHECK(i < layout_.params.size(), InvalidArgument, "ZeRO: parameter ", i, " of ",
            layout_.params.size());
  const auto& p = layout_.params[i];
  return model_.slice_rows(p.offset, p.offset + p.numel).reshape(p.shape);
}

Tensor ZeroOptimizer::grad(size_t i) const {
  OPD_CHECK(i < layout_.params.size(), InvalidArgument, "ZeRO: parameter ", i, " of ",
            layout_.params.size());
  const auto& p = layout_.params[i];
  return grad_local_.slice_rows(p.offset, p.offset + p.numel).reshape(p.shape);
}

Tensor ZeroOptimizer::flat_to_host_full(const std::vector<Tensor>& per_param,
                                        const char* what) const {
  OPD_CHECK(per_param.size() == layout_.params.size(), InvalidArgument, "ZeRO: ", what, " has ",
            per_param.size(), " tensors for ", layout_.params.size(), " parameters");
  Tensor full = Tensor::zeros({layout_.total_numel}, DType::F32);
  for (size_t i = 0; i < per_param.size(); ++i) {
    const auto& p = layout_.params[i];
    const Tensor& t = per_param[i];
    OPD_CHECK(t.defined() && t.shape() == p.shape &&
                  (t.dtype() == DType::F32 || t.dtype() == DType::BF16),
              InvalidArgument, "ZeRO: ", what, " tensor ", i, " is ",
              t.defined() ? t.describe() : std::string("undefined"), ", expected f32/bf16 ",
              shape_str(p.shape));
    Tensor h = t.to(Device::CPU);
    if (h.dtype() != DType::F32) h = h.to_dtype(DType::F32);
    full.slice_rows(p.offset, p.offset + p.numel).copy_from(h.reshape({p.numel}));
  }
  return full;
}

void ZeroOptimizer::scatter_full_into_shard(const Tensor& host_full, Tensor& shard) const {
  for (size_t b = 0; b < layout_.buckets.size(); ++b) {
    const int64_t begin = layout_.shard_begin(static_cast<int>(b), comm_.rank());
    Tensor dst = shard_view(shard, static_cast<int>(b));
    dst.copy_from(host_full.slice_rows(begin, begin + layout_.buckets[b].shard_numel));
  }
}

void ZeroOptimizer::load_weights(const std::vector<Tensor>& weights) {
  Tensor full = flat_to_host_full(weights, "weights");
  scatter_full_into_shard(full, master_);
  model_.copy_from(config_.model_dtype == DType::F32 ? full : full.to_dtype(config_.model_dtype));
}

void ZeroOptimizer::reduce_bucket(int b) {
  OPD_CHECK(b >= 0 && b < static_cast<int>(layout_.buckets.size()), InvalidArgument,
            "ZeRO: bucket ", b, " of ", layout_.buckets.size());
  if (device_ == Device::CPU) return reduce_bucket_now(b);
#ifdef OPD_WITH_CUDA
  if (!comm_stream_) comm_stream_ = std::make_unique<CommStream>();
  CommStream& cs = *comm_stream_;
  // The communication stream starts this bucket only after the compute stream's work so far
  // (the backward kernels that wrote it); everything of the reduction, including the shard
  // accumulation and the clearing of the local bucket, runs there in order.
  cs.compute_done.record(::opd::cuda::current_stream());
  OPD_CUDA_CHECK(cudaStreamWaitEvent(cs.stream.get(), cs.compute_done.get(), 0));
  {
    ::opd::cuda::StreamScope on_comm(cs.stream.get());
    reduce_bucket_now(b);
  }
  cs.comm_done.record(cs.stream.get());
  cs.pending = true;
#endif
}

void ZeroOptimizer::wait_reductions() {
#ifdef OPD_WITH_CUDA
  if (!comm_stream_ || !comm_stream_->pending) return;
  OPD_CUDA_CHECK(cudaStreamWaitEvent(::opd::cuda::current_stream(), comm_stream_->comm_done.get(), 0));
  comm_stream_->pending = false;
#endif
}

void ZeroOptimizer::reduce_bucket_now(int b) {
  const auto& bk = layout_.buckets[b];
  Tensor local = grad_local_.slice_rows(bk.offset, bk.offset + bk.numel);
  Tensor reduced = scratch_.slice_rows(0, bk.shard_numel);
  comm_.reduce_scatter(local, reduced, config_.grad_reduce);
  Tensor shard = shard_view(grad_shard_, b);
  ops::add_inplace(shard, reduced);
  local.fill_zero();
}

void ZeroOptimizer::reduce_all() {
  for (size_t b = 0; b < layout_.buckets.size(); ++b) reduce_bucket(static_cast<int>(b));
}

void ZeroOptimizer::zero_grad() {
  wait_reductions();
  grad_local_.fill_zero();
  grad_shard_.fill_zero();
}

double ZeroOptimizer::local_sum_squares() {
  if (device_ == Device::CPU) {
    double total = 0;  // f64, in order (as AdamW's CPU norm)
    const float* g = grad_shard_.data<float>();
    for (int64_t i = 0; i < grad_shard_.numel(); ++i) total += static_cast<double>(g[i]) * g[i];
    return total;
  }
  comm_.synchronize();
  const double n = adamw_->grad_norm();  // fixed-order device reduction, read back
  return n * n;
}

double ZeroOptimizer::grad_norm() {
  wait_reductions();
  auto s = comm_.store().all_reduce({local_sum_squares()}, HostReduce::Sum, "zero grad norm");
  return std::sqrt(s[0]);
}

int64_t ZeroOptimizer::steps() const { return adamw_->steps(); }

StepReport ZeroOptimizer::step(double lr, double max_norm) {
  OPD_CHECK(!std::isnan(max_norm), InvalidArgument, "ZeRO: max_norm is NaN");
  if (config_.stage == ZeroStage::One) reduce_all();
  wait_reductions();
  StepReport report;
  if (max_norm > 0 && std::isfinite(max_norm)) {
    report.grad_norm = grad_norm();
    report.norm_computed = true;
  }
  apply(lr, max_norm, report);
  return report;
}

bool ZeroOptimizer::step_if_finite(double lr, double max_norm, StepReport* report) {
  OPD_CHECK(!std::isnan(max_norm), InvalidArgument, "ZeRO: max_norm is NaN");
  if (config_.stage == ZeroStage::One) reduce_all();
  wait_reductions();
  StepReport r;
  r.grad_norm = grad_norm();  // all-reduced: every rank takes the same branch
  r.norm_computed = true;
  if (report) *report = r;
  if (!std::isfinite(r.grad_norm)) {
    zero_grad();
    return false;
  }
  apply(lr, max_norm, r);
  if (report) *report = r;
  return true;
}

void ZeroOptimizer::apply(double lr, double max_norm, StepReport& report) {
  if (max_norm > 0 && std::isfinite(max_norm)) {
    report.clip_coef = clip_coefficient(report.grad_norm, max_norm);
    const float coef = static_cast<float>(report.clip_coef);
    if (coef != 1.0f) {
      if (device_ == Device::CPU) {
        float* g = grad_shard_.data<float>();
        for (int64_t i = 0; i < grad_shard_.numel(); ++i) g[i] = g[i] * coef;
      } else {
#ifdef OPD_WITH_CUDA
        cuda::scale_inplace_f32(grad_shard_.data<float>(), grad_shard_.numel(), coef,
                                ::opd::cuda::current_stream());
#endif
      }
    }
  }
  adamw_->step(lr, 0);
  gather_model();
  grad_shard_.fill_zero();
}

void ZeroOptimizer::gather_model() {
  for (size_t b = 0; b < layout_.buckets.size(); ++b) {
    const auto& bk = layout_.buckets[b];
    const int64_t begin = layout_.shard_begin(static_cast<int>(b), comm_.rank());
    Tensor full = model_.slice_rows(bk.offset, bk.offset + bk.numel);
    Tensor mine = model_.slice_rows(begin, begin + bk.shard_numel);
    comm_.all_gather(mine, full);
  }
}

ZeroOptimizer::FullState ZeroOptimizer::gather_state() {
  wait_reductions();
  auto gather = [&](auto shard_of) {
    Tensor host_full = Tensor::zeros({layout_.total_numel}, DType::F32);
    for (size_t b = 0; b < layout_.buckets.size(); ++b) {
      const auto& bk = layout_.buckets[b];
      Tensor full_b = Tensor::empty({bk.numel}, DType::F32, device_);
      comm_.all_gather(shard_of(static_cast<int>(b)), full_b);
      comm_.synchronize();
      host_full.slice_rows(bk.offset, bk.offset + bk.numel).copy_from(full_b);
    }
    std::vector<Tensor> out;
    for (const auto& p : layout_.params)
      out.push_back(host_full.slice_rows(p.offset, p.offset + p.numel).reshape(p.shape).clone());
    return out;
  };
  FullState s;
  s.master = gather([&](int b) { return shard_view(master_, b); });
  s.exp_avg = gather([&](int b) { return adamw_->exp_avg()[b]; });
  s.exp_avg_sq = gather([&](int b) { return adamw_->exp_avg_sq()[b]; });
  s.steps = adamw_->steps();
  return s;
}

void ZeroOptimizer::load_state(const FullState& state) {
  wait_reductions();
  Tensor master = flat_to_host_full(state.master, "master weights");
  Tensor m = flat_to_host_full(state.exp_avg, "exp_avg");
  Tensor v = flat_to_host_full(state.exp_avg_sq, "exp_avg_sq");
  scatter_full_into_shard(master, master_);
  for (size_t b = 0; b < layout_.buckets.size(); ++b) {
    const int64_t begin = layout_.shard_begin(static_cast<int>(b), comm_.rank());
    const int64_t n = layout_.buckets[b].shard_numel;
    adamw_->exp_avg()[b].copy_from(m.slice_rows(begin, begin + n));
    adamw_->exp_avg_sq()[b].copy_from(v.slice_rows(begin, begin + n));
  }
  adamw_->set_steps(state.steps);
  model_.copy_from(config_.model_dtype == DType::F32 ? master : master.to_dtype(config_.model_dtype));
  zero_grad();
}

ZeroOptimizer::ShardState ZeroOptimizer::shard_state() {
  wait_reductions();
  comm_.synchronize();  // the last step's AdamW and collectives have finished (NCCL errors surface)
  ShardState s;
  s.master = master_.to(Device::CPU);
  auto concat = [&](const std::vector<Tensor>& per_bucket) {
    Tensor host = Tensor::empty({layout_.shard_numel}, DType::F32);
    for (size_t b = 0; b < layout_.buckets.size(); ++b) {
      Tensor dst = shard_view(host, static_cast<int>(b));
      dst.copy_from(per_bucket[b]);
    }
    return host;
  };
  s.exp_avg = concat(adamw_->exp_avg());
  s.exp_avg_sq = concat(adamw_->exp_avg_sq());
  s.steps = adamw_->steps();
  return s;
}

void ZeroOptimizer::load_shard_state(const ShardState& state) {
  wait_reductions();
  for (const auto* t : {&state.master, &state.exp_avg, &state.exp_avg_sq})
    OPD_CHECK(t->defined() && t->dtype() == DType::F32 && t->shape() == Shape{layout_.shard_numel},
              InvalidArgument, "ZeRO: a shard state tensor is ",
              t->defined() ? t->describe() : std::string("undefined"), ", expected f32[",
              layout_.shard_numel, "]");
  OPD_CHECK(state.steps >= 0, InvalidArgument, "ZeRO: negative step count ", state.steps);
  master_.copy_from(state.master);
  for (size_t b = 0; b < layout_.buckets.size(); ++b) {
    adamw_->exp_avg()[b].copy_from(shard_view(state.exp_avg, static_cast<int>(b)));
    adamw_->exp_avg_sq()[b].copy_from(shard_view(state.exp_avg_sq, static_cast<int>(b)));
  }
  adamw_->set_steps(state.steps);
  model_from_master();
  zero_grad();
}

void ZeroOptimizer::model_from_master() {
  for (size_t b = 0; b < layout_.buckets.size(); ++b) {
    const int64_t begin = layout_.shard_begin(static_cast<int>(b), comm_.rank());
    Tensor src = shard_view(master_, static_cast<int>(b));
    Tensor dst = model_.slice_rows(begin, begin + layout_.buckets[b].shard_numel);
    if (config_.model_dtype == DType::F32) dst.copy_from(src);
    else if (device_ == Device::CPU) dst.copy_from(src.to_dtype(config_.model_dtype));
    else ops::convert(src, dst);  // round to nearest even, as AdamW's model copy
  }
  gather_model();
}

Tensor ZeroOptimizer::gather_master_bucket(int b, bool want_host) {
  OPD_CHECK(b >= 0 && b < static_cast<int>(layout_.buckets.size()), InvalidArgument,
            "ZeRO: bucket ", b, " of ", layout_.buckets.size());
  wait_reductions();  // no NCCL call of the communication stream may run alongside this one
  const auto& bk = layout_.buckets[b];
  Tensor full = Tensor::empty({bk.numel}, DType::F32, device_);
  comm_.all_gather(shard_view(master_, b), full);
  comm_.synchronize();
  if (!want_host) return Tensor();
  return device_ == Device::CPU ? full : full.to(Device::CPU);
}

}  // namespace opd::dist
