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
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace opd {

class Transformer;

class WeightOffload {
 public:
  // model: CUDA bf16 or f32 weights. Copies them into pinned host memory (once) and releases
  // the device copies. Throws Unsupported in builds without CUDA, InvalidArgument for a host model.
  explicit WeightOffload(std::shared_ptr<Transformer> model);
  ~WeightOffload();
  WeightOffload(const WeightOffload&) = delete;
  WeightOffload& operator=(const WeightOffload&) = delete;

  void upload();   // no-op when resident
  void release();  // no-op when not resident
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

  std::shared_ptr<Transformer> model_;
  DType dtype_;
  std::vector<Slot> slots_;  // ModelWeights::for_each order
  int64_t numel_ = 0, bytes_ = 0;
  int64_t uploads_ = 0;
  std::shared_ptr<void> host_;  // pinned
  Tensor device_;               // the flat device buffer while resident
};

}  // namespace opd
