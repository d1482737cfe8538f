// WeightOffload (model/offload.h): one pinned host copy of a CUDA model's weights, uploaded to
// one flat device buffer in a single copy and released by dropping it.
#include "model/offload.h"

#include "core/error.h"
#include "model/transformer.h"

#ifdef OPD_WITH_CUDA
#include <cuda_runtime_api.h>

#include "core/cuda/allocator.h"  // current_stream
#include "core/cuda/stream.h"     // OPD_CUDA_CHECK
#endif

namespace opd {

#ifdef OPD_WITH_CUDA
struct WeightOffload::Layered {
  cuda::Stream copy;
  cuda::Event allocated;
  std::vector<std::unique_ptr<cuda::Event>> arrived;  // per group
};
#else
struct WeightOffload::Layered {};
#endif

namespace {
// Every parameter starts on a 256-byte boundary, as a separately allocated tensor does:
// cuBLASLt picks its kernels by operand alignment up to 256 bytes (kernels/cuda/gemm.cpp), so a
// smaller alignment would change the algorithm, and with it the result bits, after an upload.
constexpr int64_t kAlignBytes = 256;
}

WeightOffload::WeightOffload(std::shared_ptr<Transformer> model) : model_(std::move(model)) {
  OPD_CHECK(model_ != nullptr, InvalidArgument, "weight offload: no model");
  OPD_CHECK(model_->device() == Device::CUDA, InvalidArgument,
            "weight offload: the model must have CUDA weights");
  dtype_ = model_->dtype();
#ifdef OPD_WITH_CUDA
  const int64_t kAlign = kAlignBytes / static_cast<int64_t>(dtype_size(dtype_));  // elements
  // Groups in the order of use (WeightArrival): for_each visits the embedding, the layers in
  // order, then the final norm (and an untied lm_head), which is also the layout's order.
  const int64_t L = model_->config().num_hidden_layers;
  group_end_.assign(static_cast<size_t>(L + 2), 0);
  int64_t last_group = 0;
  model_->weights().for_each([&](const std::string& name, Tensor& w) {
    int64_t group = L + 1;
    if (name.find("embed_tokens") != std::string::npos) {
      group = 0;
      embedding_offset_ = numel_;
    } else if (const size_t at = name.find("layers."); at != std::string::npos) {
      group = 1 + std::stoll(name.substr(at + 7));
    }
    OPD_CHECK(group >= last_group && group <= L + 1, Internal, "weight offload: parameter ", name,
              " out of the layer order");
    last_group = group;
    slots_.push_back(Slot{&w, w.shape(), numel_});
    numel_ += (w.numel() + kAlign - 1) / kAlign * kAlign;
    group_end_[static_cast<size_t>(group)] = numel_;
  });
  for (size_t g = 1; g < group_end_.size(); ++g)  // empty groups end where the previous did
    group_end_[g] = std::max(group_end_[g], group_end_[g - 1]);
  bytes_ = numel_ * static_cast<int64_t>(dtype_size(dtype_));
  void* host = nullptr;
  OPD_CUDA_CHECK(cudaHostAlloc(&host, static_cast<size_t>(bytes_), cudaHostAllocDefault));
  host_ = std::shared_ptr<void>(host, [](void* p) { cudaFreeHost(p); });
  // Gather the device weights into the host layout (once): one copy per parameter, then wait.
  cudaStream_t stream = cuda::current_stream();
  const size_t esize = dtype_size(dtype_);
  for (const Slot& slot : slots_)
    OPD_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(host) + slot.offset * esize,
                                   slot.target->raw(), slot.target->nbytes(),
                                   cudaMemcpyDeviceToHost, stream));
  OPD_CUDA_CHECK(cudaStreamSynchronize(stream));
  bind(Tensor());  // the device copies are dropped here
#else
  OPD_FAIL(Unsupported, "weight offload: this build has no CUDA backend");
#endif
}

WeightOffload::~WeightOffload() {
  forget_layered();  // the model keeps the weights bound (they share the flat buffer)
}

void WeightOffload::bind(const Tensor& flat) {
  for (const Slot& slot : slots_) {
    int64_t n = 1;
    for (int64_t d : slot.shape) n *= d;
    *slot.target = flat.defined() ? flat.slice_rows(slot.offset, slot.offset + n).reshape(slot.shape)
                                  : Tensor();
  }
  ModelWeights& w = model_->weights();
  if (w.tied) w.lm_head = w.embed_tokens;
}

void WeightOffload::upload() {
  if (resident()) return;
#ifdef OPD_WITH_CUDA
  Tensor flat = Tensor::empty({numel_}, dtype_, Device::CUDA);
  // Pinned source: an asynchronous DMA on the current stream, ordered before every kernel that
  // reads the weights next; the host copy is never written after construction.
  OPD_CUDA_CHECK(cudaMemcpyAsync(flat.raw(), host_.get(), static_cast<size_t>(bytes_),
                                 cudaMemcpyHostToDevice, cuda::current_stream()));
  make_resident(flat, /*layered=*/false);
#endif
}

void WeightOffload::make_resident(const Tensor& flat, bool layered) {
  device_ = flat;
  bind(flat);
  model_->set_weight_arrival(layered ? this : nullptr);
  in_flight_ = layered;
  ++uploads_;
}

void WeightOffload::forget_layered() noexcept {
  if (!in_flight_) return;
#ifdef OPD_WITH_CUDA
  // Stream-ordered free of the buffer (or its last reader's queue): after the last copy landed
  // (group 0's, the last one issued).
  (void)cudaStreamWaitEvent(cuda::current_stream(), layered_->arrived.front()->get(), 0);
#endif
  model_->set_weight_arrival(nullptr);
  in_flight_ = false;
}

void WeightOffload::upload_layered() {
  if (resident()) return;
#ifdef OPD_WITH_CUDA
  if (!layered_) {
    layered_ = std::make_unique<Layered>();
    for (size_t g = 0; g < group_end_.size(); ++g)
      layered_->arrived.push_back(std::make_unique<cuda::Event>());
  }
  cudaStream_t stream = cuda::current_stream();
  Tensor flat = Tensor::empty({numel_}, dtype_, Device::CUDA);
  // The caching allocator hands out blocks stream-ordered on `stream`: the copy stream may write
  // only after what `stream` queued before (a previous user of the block) has run.
  layered_->allocated.record(stream);
  OPD_CUDA_CHECK(cudaStreamWaitEvent(layered_->copy.get(), layered_->allocated.get(), 0));
  const size_t esize = dtype_size(dtype_);
  // Group g spans [end of g - 1, end of g) of the layout; copied in the order 1, 2, ..., last,
  // then 0 (the embedding: see the header), each followed by its event. The last event (group
  // 0's) therefore follows every copy: wait_all.
  auto copy_group = [&](size_t g) {
    const int64_t begin = g == 0 ? 0 : group_end_[g - 1], end = group_end_[g];
    if (end > begin)
      OPD_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(flat.raw()) + begin * esize,
                                     static_cast<const char*>(host_.get()) + begin * esize,
                                     static_cast<size_t>(end - begin) * esize,
                                     cudaMemcpyHostToDevice, layered_->copy.get()));
    layered_->arrived[g]->record(layered_->copy.get());
  };
  for (size_t g = 1; g < group_end_.size(); ++g) copy_group(g);
  copy_group(0);
  make_resident(flat, /*layered=*/true);
  host_lookup_done_ = false;
#endif
}

void WeightOffload::wait(int64_t group, cudaStream_t stream) const {
#ifdef OPD_WITH_CUDA
  OPD_CHECK(layered_ && group >= 0 && group < static_cast<int64_t>(layered_->arrived.size()),
            Internal, "weight offload: wait for group ", group);
  OPD_CUDA_CHECK(cudaStreamWaitEvent(stream, layered_->arrived[static_cast<size_t>(group)]->get(), 0));
#else
  (void)group;
  (void)stream;
#endif
}

void WeightOffload::wait_all(cudaStream_t stream) const { wait(0, stream); }  // copied last

const void* WeightOffload::host_embedding() const {
  if (!in_flight_ || host_lookup_done_ || embedding_offset_ < 0) return nullptr;
  host_lookup_done_ = true;
  return static_cast<const char*>(host_.get()) + embedding_offset_ * static_cast<int64_t>(dtype_size(dtype_));
}

void WeightOffload::release() {
  if (!resident()) return;
  forget_layered();
  bind(Tensor());
  device_ = Tensor();  // back to the caching allocator (stream-ordered: queued readers finish first)
}

}  // namespace opd
