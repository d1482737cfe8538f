// Device-side validation of data-carried indices (DESIGN.md invariant 1: no index is trusted):
// one pass over the values sets an error flag to the first bad row (atomicMin, so the report
// matches the CPU check's "first row"), counts rows that are not the ignore index, and the
// host reads the two ints back into pinned memory. Ops run it before their main kernel, so a
// bad index never reaches a load and nothing is written when the data is rejected.
#include <cuda_runtime.h>

#include <climits>

#include "core/cuda/allocator.h"
#include "core/cuda/stream.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_ops.h"

namespace opd::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kIgnore = -100;

// flags[0] = first bad row (INT_MAX: none), flags[1] = number of counted rows.
__global__ void check_indices_kernel(const int32_t* values, int64_t n, IndexRule rule,
                                     int64_t limit, int* flags) {
  int bad = INT_MAX;
  int counted = 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int32_t v = values[i];
    bool ok;
    switch (rule) {
      case IndexRule::InRange: ok = v >= 0 && v < limit; break;
      case IndexRule::InRangeOrIgnore: ok = v == kIgnore || (v >= 0 && v < limit); break;
      case IndexRule::InRangeOrNone: ok = v == -1 || (v >= 0 && v < limit); break;
      default: ok = v >= 0; break;
    }
    if (!ok && static_cast<int>(i) < bad) bad = static_cast<int>(i);
    counted += (rule != IndexRule::InRangeOrIgnore || v != kIgnore) ? 1 : 0;
  }
  // Integer reductions: exact and order-independent, so atomics keep this deterministic.
  for (int o = 16; o > 0; o >>= 1) {
    bad = min(bad, __shfl_xor_sync(0xffffffffu, bad, o));
    counted += __shfl_xor_sync(0xffffffffu, counted, o);
  }
  if ((threadIdx.x & 31) == 0) {
    if (bad != INT_MAX) atomicMin(&flags[0], bad);
    if (counted) atomicAdd(&flags[1], counted);
  }
}

__global__ void init_flags_kernel(int* flags) {
  flags[0] = INT_MAX;
  flags[1] = 0;
}

// Pinned host slots for the read-back (one per host thread: ops may run on several threads).
struct PinnedFlags {
  int* host = nullptr;
  PinnedFlags() { OPD_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&host), 4 * sizeof(int), cudaHostAllocDefault)); }
  ~PinnedFlags() {
    if (host) (void)cudaFreeHost(host);
  }
};

}  // namespace

IndexCheckResult check_indices(const int32_t* values, int64_t n, IndexRule rule, int64_t limit,
                               cudaStream_t stream) {
  IndexCheckResult result;
  if (n == 0) return result;
  OPD_CHECK(n < INT_MAX, Unsupported, "index check over ", n, " rows (limit ", INT_MAX, ")");
  thread_local PinnedFlags pinned;
  DeviceBuffer flags(2 * sizeof(int), stream);
  init_flags_kernel<<<1, 1, 0, stream>>>(flags.as<int>());
  check_launch("init_flags_kernel");
  check_indices_kernel<<<grid_for(n, kThreads, 1024), kThreads, 0, stream>>>(values, n, rule, limit,
                                                                             flags.as<int>());
  check_launch("check_indices_kernel");
  OPD_CUDA_CHECK(cudaMemcpyAsync(pinned.host, flags.get(), 2 * sizeof(int), cudaMemcpyDeviceToHost,
                                 stream));
  OPD_CUDA_CHECK(cudaStreamSynchronize(stream));
  result.counted = pinned.host[1];
  if (pinned.host[0] != INT_MAX) {
    result.first_bad_row = pinned.host[0];
    OPD_CUDA_CHECK(cudaMemcpyAsync(pinned.host + 2, values + result.first_bad_row, sizeof(int32_t),
                                   cudaMemcpyDeviceToHost, stream));
    OPD_CUDA_CHECK(cudaStreamSynchronize(stream));
    result.value = pinned.host[2];
  }
  return result;
}

int sm_count() {
  static int counts[64] = {};
  int device = 0;
  OPD_CUDA_CHECK(cudaGetDevice(&device));
  if (device >= 64) device = 63;
  if (counts[device] == 0) {
    int c = 0;
    OPD_CUDA_CHECK(cudaDeviceGetAttribute(&c, cudaDevAttrMultiProcessorCount, device));
    counts[device] = c;
  }
  return counts[device];
}

int max_active_clusters(const void* kernel, int threads, size_t smem_bytes, int size) {
  OPD_CHECK(size >= 1 && size <= 16 && threads >= 1, InvalidArgument, "max_active_clusters: size ",
            size, ", threads ", threads);
  if (size > 8)
    OPD_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(sm_count() / size * size));
  cfg.blockDim = dim3(static_cast<unsigned>(threads));
  cfg.dynamicSmemBytes = smem_bytes;
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = static_cast<unsigned>(size);
  attr.val.clusterDim.y = 1;
  attr.val.clusterDim.z = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  int n = 0;
  if (cudaOccupancyMaxActiveClusters(&n, kernel, &cfg) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;  // no clusters of this size
  }
  return n;
}

}  // namespace opd::cuda
