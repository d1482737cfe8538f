// Deterministic column sums on CUDA: out[c] += sum_r x[r, c] in fixed-order stages
// (row groups -> f32 partials, then a tree over groups whose shape depends only on the sizes),
// so gradients such as dbias and dw are bit-identical run to run (no float atomics).
#include <cuda_runtime.h>

#include <algorithm>

#include "core/cuda/allocator.h"
#include "core/cuda/stream.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_ops.h"

namespace opd::cuda {
namespace {

// Block = 32 columns x 8 stripes; grid.y = chunks of kChunk groups. Stripe y sums the groups
// y, y+8, ... of its chunk in order, then the 8 stripe sums are added in index order and
// either written as the chunk's partial or (one chunk left) added to out.
constexpr int kCols = 32, kStripes = 8, kChunk = 64;

__global__ void reduce_level_kernel(const float* partial, int64_t groups, int64_t h, float* next,
                                    bool accumulate) {
  __shared__ float s[kStripes][kCols + 1];
  const int64_t c = blockIdx.x * static_cast<int64_t>(kCols) + threadIdx.x;
  const int64_t g0 = blockIdx.y * static_cast<int64_t>(kChunk);
  const int64_t g1 = min(groups, g0 + kChunk);
  float acc = 0;
  if (c < h)
    for (int64_t g = g0 + threadIdx.y; g < g1; g += kStripes) acc += partial[g * h + c];
  s[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && c < h) {
    float total = 0;
#pragma unroll
    for (int y = 0; y < kStripes; ++y) total += s[y][threadIdx.x];
    if (accumulate) next[c] += total;
    else next[blockIdx.y * h + c] = total;
  }
}

// partial[g, c] = sum of x[r, c] over the rows of group g (rows_per_group consecutive rows).
template <typename T>
__global__ void column_partials_kernel(const T* x, int64_t n, int64_t h, int64_t rows_per_group,
                                       float* partial) {
  const int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (c >= h) return;
  const int64_t g = blockIdx.y;
  const int64_t r1 = min(n, (g + 1) * rows_per_group);
  float acc = 0;
  for (int64_t r = g * rows_per_group; r < r1; ++r) acc += dev::to_f32(x[r * h + c]);
  partial[g * h + c] = acc;
}

}  // namespace

void reduce_partials_accumulate(const float* partial, int64_t groups, int64_t h, float* out,
                                cudaStream_t stream) {
  if (h == 0 || groups == 0) return;
  const unsigned col_blocks = static_cast<unsigned>((h + kCols - 1) / kCols);
  DeviceBuffer bufs[2];
  int which = 0;
  while (groups > kChunk) {
    const int64_t chunks = (groups + kChunk - 1) / kChunk;
    bufs[which] = DeviceBuffer(static_cast<size_t>(chunks * h) * sizeof(float), stream);
    reduce_level_kernel<<<dim3(col_blocks, static_cast<unsigned>(chunks)), dim3(kCols, kStripes),
                          0, stream>>>(partial, groups, h, bufs[which].as<float>(), false);
    check_launch("reduce_level_kernel");
    partial = bufs[which].as<float>();
    groups = chunks;
    which ^= 1;
  }
  reduce_level_kernel<<<dim3(col_blocks, 1), dim3(kCols, kStripes), 0, stream>>>(partial, groups,
                                                                                 h, out, true);
  check_launch("reduce_level_kernel");
}

void column_sum_accumulate(const void* x, int64_t n, int64_t h, DType dtype, float* out,
                           cudaStream_t stream) {
  if (n == 0 || h == 0) return;
  // Groups depend only on the shape (determinism across GPUs): ~512 blocks in all, each group
  // at least 16 rows long so its partial row is cheap next to the rows it sums.
  const int64_t col_blocks = (h + 255) / 256;
  int64_t groups = std::max<int64_t>(1, std::min<int64_t>((n + 15) / 16, 512 / col_blocks + 1));
  const int64_t rows_per_group = (n + groups - 1) / groups;
  groups = (n + rows_per_group - 1) / rows_per_group;
  DeviceBuffer partial(static_cast<size_t>(groups * h) * sizeof(float), stream);
  const dim3 grid(static_cast<unsigned>(col_blocks), static_cast<unsigned>(groups));
  if (dtype == DType::F32) {
    column_partials_kernel<float><<<grid, 256, 0, stream>>>(static_cast<const float*>(x), n, h,
                                                            rows_per_group, partial.as<float>());
  } else if (dtype == DType::BF16) {
    column_partials_kernel<__nv_bfloat16><<<grid, 256, 0, stream>>>(
        static_cast<const __nv_bfloat16*>(x), n, h, rows_per_group, partial.as<float>());
  } else {
    OPD_FAIL(Unsupported, "CUDA column_sum_accumulate for dtype ", dtype_name(dtype));
  }
  check_launch("column_partials_kernel");
  reduce_partials_accumulate(partial.as<float>(), groups, h, out, stream);
}

}  // namespace opd::cuda
