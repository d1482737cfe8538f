// Weight offload of a CUDA Transformer: its weights live in one pinned host buffer and are on
// the GPU only between upload() and release() (the trainer's in-process teacher with
// `--offload-teacher`: on the device for its scoring, away during the rollout and the training
// phase, so those phases have its P x dtype bytes free).
//
// Layout: every distinct parameter (tied embeddings once) at an offset rounded up to 256 bytes
// (cuBLASLt chooses kernels by operand alignment up to 256 bytes: with the alignment of separate
// allocations the GEMMs, and so the bits, are those of the model before the offload) in one flat
// buffer of the model dtype, the same on the host and the device, so an upload is one cudaMemcpyAsync
// of the whole buffer on the current stream (ordered before the kernels that read it; no host
// sync) and a release drops one device block. While released the model's weight tensors are
// undefined: using the model then fails on an undefined tensor instead of reading freed memory.
// Cost per upload: bytes / host-to-device bandwidth (PCIe 5: ~3.4 GB in ~70 ms).
// upload_layered() hides most of it behind the forward that reads the weights: the groups (each
// layer, the final norm, then the embedding) are copied in that order on a copy stream, one event
// per group, and the model's CUDA forward waits for each group right before its first use
// (Transformer::set_weight_arrival); its first layer starts after that layer's copy instead of
// the whole model's. The first forward after the upload looks its tokens up in the embedding's
// pinned host copy (kernels read it over the bus: T rows, not the whole table), so the embedding
// (the largest group: 622 MB for a 1.7B Qwen3) is copied last, behind the layers; a tied lm_head
// is the embedding again, needed only after every layer. (Until session 16 the embedding went
// first and scoring waited for it: ~12 ms of W1's ~20 ms offload cost.)
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "model/transformer.h"  // WeightArrival

namespace opd {

class WeightOffload : public WeightArrival {
 public:
  // model: CUDA bf16 or f32 weights. Copies them into pinned host memory (once) and releases
  // the device copies. Throws Unsupported in builds without CUDA, InvalidArgument for a host model.
  explicit WeightOffload(std::shared_ptr<Transformer> model);
  ~WeightOffload() override;
  WeightOffload(const WeightOffload&) = delete;
  WeightOffload& operator=(const WeightOffload&) = delete;

  void upload();   // no-op when resident
  // The same copy group by group on a copy stream, the model's forward waiting per group (see
  // above); readers other than the CUDA forward must call Transformer::wait_for_weights first
  // (PagedForward does). No-op when resident.
  void upload_layered();
  void release();  // no-op when not resident; after a layered upload, waits for its copies
  // WeightArrival (while a layered upload is bound to the model).
  void wait(int64_t group, cudaStream_t stream) const override;
  void wait_all(cudaStream_t stream) const override;
  const void* host_embedding() const override;
  bool resident() const { return device_.defined(); }
  int64_t bytes() const { return bytes_; }
  int64_t uploads() const { return uploads_; }

 private:
  struct Slot {
    Tensor* target;      // the model's parameter (ModelWeights::for_each at construction: it
                         // skips undefined optional tensors, so it cannot be re-walked later)
    Shape shape;
    int64_t offset = 0;  // elements into the flat buffer
  };
  void bind(const Tensor& flat);  // points the model's weights at views of `flat`
  // flat is the model's now; layered: its copies are in flight (the model waits through us).
  void make_resident(const Tensor& flat, bool layered);
  // A layered upload's copies: the current stream waits for the last one, the model forgets us.
  void forget_layered() noexcept;

  std::shared_ptr<Transformer> model_;
  DType dtype_;
  std::vector<Slot> slots_;  // ModelWeights::for_each order
  int64_t numel_ = 0, bytes_ = 0;
  int64_t uploads_ = 0;
  std::shared_ptr<void> host_;  // pinned
  Tensor device_;               // the flat device buffer while resident
  // Element offset where each group ends (groups as in WeightArrival: embedding, layers, final).
  std::vector<int64_t> group_end_;
  struct Layered;                    // the copy stream and the per-group events (CUDA)
  std::unique_ptr<Layered> layered_;
  bool in_flight_ = false;           // the last upload was layered (the model holds `this`)
  int64_t embedding_offset_ = -1;    // elements into the flat buffer (-1: no embedding slot)
  mutable bool host_lookup_done_ = false;  // host_embedding() served this upload's first forward
};

}  // namespace opd
