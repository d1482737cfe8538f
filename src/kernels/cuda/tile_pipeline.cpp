// The two-stream tile double buffer (contract, ordering and capture rule in
// kernels/cuda/tile_pipeline.h): a process-wide side stream per device and five events per
// pipeline (produced/consumed per slot, fork, join), all without timing (cheaper records).
#include "kernels/cuda/tile_pipeline.h"

#include <cuda_runtime.h>

#include <map>
#include <mutex>

#include "core/cuda/cuda_check.h"

namespace opd::cuda {
namespace {

// Non-blocking: a side stream that synchronized with the legacy default stream would serialize
// against a caller on stream 0 (bench loss, the trainer's dispatch) and hide nothing.
cudaStream_t side_stream() {
  static std::mutex* mutex = new std::mutex();
  static auto* streams = new std::map<int, cudaStream_t>();  // never destroyed (header)
  int device = 0;
  OPD_CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(*mutex);
  auto it = streams->find(device);
  if (it != streams->end()) return it->second;
  cudaStream_t s = nullptr;
  OPD_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  streams->emplace(device, s);
  return s;
}

cudaEvent_t make_event() {
  cudaEvent_t e = nullptr;
  OPD_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  return e;
}

}  // namespace

TilePipeline::TilePipeline(cudaStream_t main, TileOverlap mode) : main_(main) {
  if (mode != TileOverlap::On) return;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  OPD_CUDA_CHECK(cudaStreamIsCapturing(main, &capture));
  if (capture != cudaStreamCaptureStatusNone) return;  // the serial schedule (header)
  side_ = side_stream();
  try {
    for (int s = 0; s < 2; ++s) {
      produced_[s] = make_event();
      consumed_[s] = make_event();
    }
    fork_ = make_event();
    join_ = make_event();
    // Fork: the side stream starts after everything the caller issued on main so far (inputs,
    // the row state's initialization, earlier passes that read the slot buffers).
    OPD_CUDA_CHECK(cudaEventRecord(fork_, main_));
    OPD_CUDA_CHECK(cudaStreamWaitEvent(side_, fork_, 0));
  } catch (...) {
    for (cudaEvent_t e : {produced_[0], produced_[1], consumed_[0], consumed_[1], fork_, join_})
      if (e) (void)cudaEventDestroy(e);
    throw;
  }
  overlapped_ = true;
  joined_ = false;
}

TilePipeline::~TilePipeline() {
  if (!overlapped_) return;
  if (!joined_) {
    // Unchecked join: nothing may throw here, and a failed record leaves an earlier error that
    // the caller's own checks already report.
    if (cudaEventRecord(join_, side_) == cudaSuccess) (void)cudaStreamWaitEvent(main_, join_, 0);
  }
  // Destroying an event with pending work is allowed: its resources are released when the
  // work completes.
  for (cudaEvent_t e : {produced_[0], produced_[1], consumed_[0], consumed_[1], fork_, join_})
    (void)cudaEventDestroy(e);
}

cudaStream_t TilePipeline::produce(int64_t step) {
  OPD_CHECK(step == next_step_, Internal, "TilePipeline: produce(", step, ") out of order (expected ",
            next_step_, ")");
  if (!overlapped_) return main_;
  const int s = slot(step);
  // The slot's previous readers (consumers of step - 2) must be done before it is overwritten.
  if (slot_used_[s]) OPD_CUDA_CHECK(cudaStreamWaitEvent(side_, consumed_[s], 0));
  return side_;
}

cudaStream_t TilePipeline::consume(int64_t step) {
  OPD_CHECK(step == next_step_, Internal, "TilePipeline: consume(", step, ") out of order");
  if (!overlapped_) return main_;
  const int s = slot(step);
  OPD_CUDA_CHECK(cudaEventRecord(produced_[s], side_));
  OPD_CUDA_CHECK(cudaStreamWaitEvent(main_, produced_[s], 0));
  return main_;
}

void TilePipeline::consumed(int64_t step) {
  OPD_CHECK(step == next_step_, Internal, "TilePipeline: consumed(", step, ") out of order");
  ++next_step_;
  if (!overlapped_) return;
  const int s = slot(step);
  OPD_CUDA_CHECK(cudaEventRecord(consumed_[s], main_));
  slot_used_[s] = true;
}

void TilePipeline::finish() {
  if (!overlapped_ || joined_) return;
  joined_ = true;  // a failed join below is not retried by the destructor
  OPD_CUDA_CHECK(cudaEventRecord(join_, side_));
  OPD_CUDA_CHECK(cudaStreamWaitEvent(main_, join_, 0));
}

}  // namespace opd::cuda
