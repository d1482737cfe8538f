// Tiled lm_head top-K on CUDA: the GPU twin of teacher/topk_lm_head.h (same formulas, same
// ordering), for the teacher scorer's vocabulary pass over device hidden rows:
//   z = h_r W^T over vocabulary tiles (cuBLASLt GEMM into a [row_chunk, vocab_tile] f32 buffer),
//   LSE_r = log sum_v exp(z_v / T)   (online: per tile max and scaled sum, merged into (m, s))
//   top-K = the K best (z desc, id asc) ids, a_k = z_{i_k} / T - LSE_r, actual = z_y / T - LSE_r,
//   rank_y = 1 + #{v : z_v > z_y} (optional, a second pass over the tiles).
//
// Running top-K per row, merged across tiles (one CTA per row per tile): every logit has a
// unique 64-bit key (order-preserving float bits << 32 | ~id), so "better" is a total order and
// the K best form an exact set. A row keeps its K best keys so far (unordered) and their minimum
// (threshold). A tile's candidates are the keys above the threshold -- once K keys are kept
// there are ~K x tile / (ids seen) of them, and the LSE pass stores them in shared memory as it
// finds them, so such a tile costs one read of the row. A tile with more candidates than
// shared memory holds (a row's first tile) gets a floor from the LSE pass instead: the K-th
// largest of the CTA's per-thread maxima is <= the K-th best logit, and the keys above it
// (~K + a few dozen) are gathered in one more read. Kept U candidates then merge into the K
// best: by ranks (<= 256 keys), else an 8-bit radix select (over the row again only when even
// the floor leaves too many, e.g. thousands of tied logits). The K entries are sorted once at
// the end (bitonic sort in shared memory).
//
// Memory (device, besides inputs and outputs):
//   topk_lm_head_cuda_workspace_bytes = min(R, row_chunk) x min(V, tile) x 4   logit tile (f32)
//                                       + R x 32 + R x K x 8                 row state, kept keys
// i.e. O(R x K + row_chunk x tile), never [R x V]. K <= kMaxK (8192) (shared memory of the merge:
// 16 K + 17 KiB per CTA); K <= 64 fits in 18 KiB (several CTAs per SM).
//
// Index safety: actual ids outside {-1} U [0, V) are reported through error_flag[1] (first bad
// row) and treated as none; non-finite logits through error_flag[0] (first row) with the first
// such id in the row state. Every slot or count the kernels take from shared memory or from the
// row state is bounded by the array it addresses before use; one outside it (a broken kernel
// invariant, never seen) is dropped and reported through error_flag[2] (first row). The Tensor-level wrapper (topk_lm_head_gpu) checks ids on the
// device before it runs and turns the flags into the CPU reference's errors.
// C++17-clean (included by the .cu file).
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/dtype.h"

typedef struct CUstream_st* cudaStream_t;

namespace opd::cuda {

constexpr int64_t kTopKLmHeadMaxK = 8192;
// Candidates of one tile that the merge keeps in shared memory (more: re-read from the tile).
constexpr int kTopKLmHeadCandCap = 2048;

struct TopKLmHeadCudaArgs {
  const void* hidden = nullptr;   // [rows, hidden_dim], device, `dtype`
  const void* lm_head = nullptr;  // [vocab, hidden_dim], device, `dtype`
  DType dtype = DType::BF16;      // bf16 or f32 (GEMM accumulates in f32 either way)
  int64_t rows = 0, hidden_dim = 0, vocab = 0;
  const int32_t* actual = nullptr;  // [rows] device, -1 = none; nullptr = no actual tokens
  int64_t k = 0;                    // 0 <= k <= min(vocab, kTopKLmHeadMaxK)
  double temperature = 1.0;         // finite, > 0
  bool want_ranks = false;
  int64_t vocab_tile = 16384;
  int64_t row_chunk = 2048;
  // Outputs (device): ids/logprobs [rows, k]; actual_logprobs [rows] (NaN where none; may be
  // nullptr); actual_ranks [rows] (0 where none) when want_ranks.
  int32_t* ids = nullptr;
  float* logprobs = nullptr;
  float* actual_logprobs = nullptr;
  int32_t* actual_ranks = nullptr;
  // Optional device uint32[3], set to 0xffffffff by the caller: [0] first row with a
  // non-finite logit, [1] first row with an actual id outside {-1} U [0, V), [2] first row where
  // a kernel invariant failed (a merge slot or kept count out of bounds; results unusable).
  unsigned* error_flag = nullptr;

  // Test seams (tests/cuda/test_cuda_topk_lm_head.cpp; the row kernels under racecheck without
  // cuBLAS, whose Hopper kernels fault under compute-sanitizer racecheck on their own):
  // f32 logits [rows, vocab] on the device; when set, hidden / lm_head / dtype / hidden_dim are
  // ignored and the row kernels read each tile in place (no GEMM).
  const float* logits = nullptr;
  // Tile candidates merged in shared memory, in [1, kTopKLmHeadCandCap]; smaller values send
  // small tiles down the global-memory merge path.
  int candidate_capacity = kTopKLmHeadCandCap;
};

size_t topk_lm_head_cuda_workspace_bytes(int64_t rows, int64_t vocab, int64_t k,
                                         int64_t vocab_tile, int64_t row_chunk);

// Stream-ordered, no host synchronization. workspace: the bytes above, device memory.
void topk_lm_head_cuda(const TopKLmHeadCudaArgs& args, void* workspace, cudaStream_t stream);

// The first id with a non-finite logit of `row` after a run (reads the row state back from the
// workspace: synchronizing; for error messages only). -1 when none.
int32_t topk_lm_head_cuda_bad_id(const void* workspace, int64_t rows, int64_t vocab,
                                 int64_t k, int64_t vocab_tile, int64_t row_chunk, int64_t row,
                                 cudaStream_t stream);

}  // namespace opd::cuda
