// Two-stream double buffer for the vocabulary-tiled lm_head passes (teacher top-K scoring,
// teacher/topk_lm_head_cuda.cu; the fused loss, loss/fused_loss_cuda.cu): per step i (one
// [row_chunk, vocab_tile] logit tile) a producer (the tile GEMMs, tensor-core bound) fills
// buffer slot i % 2 on a side stream while the consumers of step i - 1 (the row kernels,
// memory bound) read the other slot on the caller's stream, so the two overlap instead of
// idling each other. Ordering by events only:
//   producer(i)  waits for consumers(i - 2)   (the last readers of its slot)
//   consumers(i) wait  for producer(i)
//   the side stream starts after everything issued on the main stream before the pipeline
//   (fork), and the main stream waits for the side stream at finish() (join).
// The same kernels run in the same order on the same data in both modes (only the stream of
// the producers and the slot buffer differ), so results are bit-identical with the overlap on
// and off; the callers' tests assert it.
//
// The side stream is one non-blocking stream per device for the whole process (never
// destroyed, like the GEMM context): cuBLASLt keeps a 32 MiB workspace per stream
// (kernels/cuda/gemm.cpp) and cuBLAS callers keep one handle per stream, so a fresh stream per
// call would leak both. Concurrent pipelines on several host threads share it (correct: events
// order each one; their producers serialize).
// Graph capture: a pipeline whose main stream is capturing runs with one slot on the main
// stream (no fork): the side stream is shared, so it must never join a capture.
// C++17-clean, no CUDA headers: the args headers that name TileOverlap (and default it from
// the environment) are included by .cpp files of builds without CUDA, so the mode functions are
// inline here; TilePipeline itself (tile_pipeline.cpp) exists only in CUDA builds.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "core/error.h"

typedef struct CUstream_st* cudaStream_t;
typedef struct CUevent_st* cudaEvent_t;

namespace opd::cuda {

// Whether the tile GEMMs overlap the row kernels (two tile buffers, a second stream).
enum class TileOverlap { Off, On };

// The process default: OPD_LMHEAD_OVERLAP=1 -> On, unset / empty / "0" -> Off, read on first
// use (anything else throws InvalidArgument naming the variable); set_tile_overlap_default
// replaces it (benches that time both modes in one run). Thread-safe.
namespace detail {
inline std::atomic<int>& tile_overlap_state() {  // -1: not read yet; else int(TileOverlap)
  static std::atomic<int> state{-1};
  return state;
}
}  // namespace detail

inline TileOverlap tile_overlap_default() {
  std::atomic<int>& st = detail::tile_overlap_state();
  int v = st.load();
  if (v < 0) {
    const char* e = std::getenv("OPD_LMHEAD_OVERLAP");
    const std::string s = e ? e : "";
    OPD_CHECK(s.empty() || s == "0" || s == "1", InvalidArgument, "OPD_LMHEAD_OVERLAP=", s,
              ": expected 1 (overlap the lm_head tile GEMMs with the row kernels) or 0");
    int expected = -1;
    st.compare_exchange_strong(expected, s == "1" ? 1 : 0);  // a concurrent set wins
    v = st.load();
  }
  return v == 1 ? TileOverlap::On : TileOverlap::Off;
}
inline void set_tile_overlap_default(TileOverlap mode) {
  detail::tile_overlap_state().store(mode == TileOverlap::On ? 1 : 0);
}
inline const char* tile_overlap_name(TileOverlap mode) {
  return mode == TileOverlap::On ? "on" : "off";
}

class TilePipeline {
 public:
  // mode On and `main` not capturing: two slots, producers on the side stream; otherwise one
  // slot and every call returns `main` (the plain serial schedule).
  TilePipeline(cudaStream_t main, TileOverlap mode);
  // Joins the side stream into `main` if finish() was not called (an exception between steps):
  // buffers that `main`'s owner frees afterwards are then not in use. Never throws.
  ~TilePipeline();
  TilePipeline(const TilePipeline&) = delete;
  TilePipeline& operator=(const TilePipeline&) = delete;

  bool overlapped() const { return overlapped_; }
  int slots() const { return overlapped_ ? 2 : 1; }
  int slot(int64_t step) const { return static_cast<int>(step % slots()); }

  // Call in this order for step = 0, 1, 2, ... :
  //   s = produce(step);  issue the producers of `step` on s, writing slot(step)
  //   m = consume(step);  issue the consumers of `step` on m (== main), reading slot(step)
  //   consumed(step);
  // then finish() once after the last step.
  cudaStream_t produce(int64_t step);
  cudaStream_t consume(int64_t step);
  void consumed(int64_t step);
  void finish();

 private:
  cudaStream_t main_ = nullptr;
  cudaStream_t side_ = nullptr;
  bool overlapped_ = false;
  bool joined_ = true;
  // produced_[s] / consumed_[s]: the last producer / consumers of slot s; fork_, join_.
  cudaEvent_t produced_[2] = {nullptr, nullptr};
  cudaEvent_t consumed_[2] = {nullptr, nullptr};
  bool slot_used_[2] = {false, false};
  cudaEvent_t fork_ = nullptr;
  cudaEvent_t join_ = nullptr;
  int64_t next_step_ = 0;
};

}  // namespace opd::cuda
