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
  model_->weights().for_each([&](const std::string&, Tensor& w) {
    slots_.push_back(Slot{&w, w.shape(), numel_});
    numel_ += (w.numel() + kAlign - 1) / kAlign * kAlign;
  });
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

WeightOffload::~WeightOffload() = default;

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
  device_ = flat;
  bind(flat);
  ++uploads_;
#endif
}

void WeightOffload::release() {
  if (!resident()) return;
  bind(Tensor());
  device_ = Tensor();  // back to the caching allocator (stream-ordered: queued readers finish first)
}

}  // namespace opd
