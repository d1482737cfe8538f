// L2 prefetch of device byte ranges (kernels/cuda/cuda_ops.h l2_prefetch): a hint with no
// result. Decode steps read each layer's weights (4-12 MB per GEMM at W1) with 64-row GEMMs that
// are latency-bound (0.6-1.6 TB/s, docs/rollout.md); the paged attention before them streams the
// K/V cache at ~80% of the copy rate. Issuing `prefetch.global.L2::evict_last` for the next
// GEMMs' weights just before the attention lets their DRAM reads overlap it and keeps them
// resident against the streaming K/V (evict_last lines go after normal ones), so the GEMMs read
// from L2 (60 MB on the H200; one decoder layer of W1 is 31.5 MB).
#include <algorithm>
#include <cstdint>

#include "core/cuda/stream.h"
#include "kernels/cuda/cuda_ops.h"

namespace opd::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kLine = 128;  // bytes per prefetch (an L2 line)

__global__ void __launch_bounds__(kThreads) l2_prefetch_kernel(L2PrefetchRanges r) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads * kLine;
  const int64_t first = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) * kLine;
  for (int i = 0; i < r.count; ++i) {
    const char* p = static_cast<const char*>(r.ptr[i]);
    for (int64_t off = first; off < r.bytes[i]; off += stride)
      asm volatile("prefetch.global.L2::evict_last [%0];" ::"l"(p + off));
  }
}

}  // namespace

void l2_prefetch(const L2PrefetchRanges& ranges, cudaStream_t stream) {
  L2PrefetchRanges r{};
  int64_t total = 0;
  for (int i = 0; i < ranges.count && i < L2PrefetchRanges::kMax; ++i) {
    if (ranges.ptr[i] == nullptr || ranges.bytes[i] <= 0) continue;
    r.ptr[r.count] = ranges.ptr[i];
    r.bytes[r.count] = ranges.bytes[i];
    total += ranges.bytes[i];
    ++r.count;
  }
  if (r.count == 0) return;
  // A short kernel: ~16 prefetches per thread for a 31.5 MB layer on 60 CTAs.
  const int64_t lines = (total + kLine - 1) / kLine;
  const int blocks = static_cast<int>(std::min<int64_t>(60, (lines + kThreads * 16 - 1) / (kThreads * 16)));
  l2_prefetch_kernel<<<blocks, kThreads, 0, stream>>>(r);
  OPD_CUDA_CHECK(cudaGetLastError());
}

}  // namespace opd::cuda
