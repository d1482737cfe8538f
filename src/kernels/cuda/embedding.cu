// Token embedding on CUDA: out[t, :] = table[ids[t], :], and the deterministic scatter-add
// backward dtable[v, :] += sum_{t : ids[t] = v} dout[t, :] with the rows of each id added in
// ascending row order: a stable LSD radix sort (CUB) of (id, row) pairs turns every distinct id
// into a contiguous segment, and the block that owns the segment's first position sums it in
// f32 and adds it to its table row. No float atomics, so gradients are bit-identical run to run.
// ids are validated before either kernel runs (ops.cpp, check_indices); kernels still skip
// out-of-range ids so that no path can read or write outside the table.
#include <cub/device/device_radix_sort.cuh>
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>

#include "core/cuda/allocator.h"
#include "core/cuda/stream.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_ops.h"

namespace opd::cuda {
namespace {

using dev::Pack;
constexpr int kThreads = 256;

// One thread per W-element chunk of an output row.
// kHostTable: the table is pinned host memory read over the bus (a weight upload still in
// flight, model/offload.h): plain loads, not the read-only cache path.
template <typename T, int W, bool kHostTable = false>
__global__ void embedding_forward_kernel(const int32_t* ids, const T* table, int64_t n,
                                         int64_t vocab, int64_t hidden, T* out) {
  const int64_t chunks = hidden / W;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x; idx < n * chunks;
       idx += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t t = idx / chunks, c = (idx % chunks) * W;
    const int32_t id = ids[t];
    if (id < 0 || id >= vocab) continue;  // unreachable after validation; never read outside
    if constexpr (W * sizeof(T) == 16) {
      dev::store_vec(out + t * hidden + c, kHostTable ? dev::load_vec_rw(table + id * hidden + c)
                                                      : dev::load_vec(table + id * hidden + c));
    } else {
#pragma unroll
      for (int i = 0; i < W; ++i) out[t * hidden + c + i] = table[id * hidden + c + i];
    }
  }
}

__global__ void iota_kernel(int32_t* v, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * kThreads)
    v[i] = static_cast<int32_t>(i);
}

// Block b looks at sorted position b; if it starts a segment (first position of its id), the
// block sums dout over the segment's rows (in ascending row order, the stable sort's order)
// for every column and adds the sums to dtable[id, :].
template <typename T, int W>
__global__ void embedding_backward_segments_kernel(const int32_t* sorted_ids,
                                                   const int32_t* sorted_rows, const T* dout,
                                                   int64_t n, int64_t vocab, int64_t hidden,
                                                   float* dtable) {
  for (int64_t pos = blockIdx.x; pos < n; pos += gridDim.x) {
    const int32_t id = sorted_ids[pos];
    if ((pos > 0 && sorted_ids[pos - 1] == id) || id < 0 || id >= vocab) continue;
    int64_t end = pos + 1;
    while (end < n && sorted_ids[end] == id) ++end;
    for (int64_t c = static_cast<int64_t>(threadIdx.x) * W; c < hidden;
         c += static_cast<int64_t>(kThreads) * W) {
      float acc[W];
#pragma unroll
      for (int i = 0; i < W; ++i) acc[i] = 0;
      for (int64_t j = pos; j < end; ++j) {
        Pack<T, W> d;
        d.load(dout + static_cast<int64_t>(sorted_rows[j]) * hidden + c);
#pragma unroll
        for (int i = 0; i < W; ++i) acc[i] += d.f[i];
      }
      float* dst = dtable + static_cast<int64_t>(id) * hidden + c;
#pragma unroll
      for (int i = 0; i < W; ++i) dst[i] += acc[i];
    }
  }
}

template <typename T>
void forward_typed(const int32_t* ids, const void* table, int64_t n, int64_t vocab,
                   int64_t hidden, void* out, cudaStream_t stream, bool host_table) {
  constexpr int V = 16 / sizeof(T);
  const T* tb = static_cast<const T*>(table);
  T* o = static_cast<T*>(out);
  if (hidden % V == 0 && dev::aligned16(tb) && dev::aligned16(o)) {
    const unsigned grid = grid_for(n * (hidden / V), kThreads);
    if (host_table)
      embedding_forward_kernel<T, V, true><<<grid, kThreads, 0, stream>>>(ids, tb, n, vocab, hidden, o);
    else
      embedding_forward_kernel<T, V><<<grid, kThreads, 0, stream>>>(ids, tb, n, vocab, hidden, o);
  } else {
    embedding_forward_kernel<T, 1><<<grid_for(n * hidden, kThreads), kThreads, 0, stream>>>(
        ids, tb, n, vocab, hidden, o);
  }
  check_launch("embedding_forward_kernel");
}

template <typename T>
void backward_typed(const int32_t* ids, const void* dout, int64_t n, int64_t vocab,
                    int64_t hidden, float* dtable, cudaStream_t stream) {
  OPD_CHECK(n < 0x7fffffff, Unsupported, "embedding_backward over ", n, " rows");
  // Sort keys: ids (bits up to vocab - 1 only); values: row indices 0..n-1.
  int end_bit = 1;
  while (end_bit < 31 && (int64_t{1} << end_bit) < vocab) ++end_bit;
  DeviceBuffer rows_in(static_cast<size_t>(n) * sizeof(int32_t), stream);
  DeviceBuffer ids_out(static_cast<size_t>(n) * sizeof(int32_t), stream);
  DeviceBuffer rows_out(static_cast<size_t>(n) * sizeof(int32_t), stream);
  iota_kernel<<<grid_for(n, kThreads), kThreads, 0, stream>>>(rows_in.as<int32_t>(), n);
  check_launch("iota_kernel");
  size_t temp_bytes = 0;
  const int items = static_cast<int>(n);
  OPD_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, ids, ids_out.as<int32_t>(),
                                                 rows_in.as<int32_t>(), rows_out.as<int32_t>(),
                                                 items, 0, end_bit, stream));
  DeviceBuffer temp(std::max<size_t>(temp_bytes, 1), stream);
  OPD_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp.get(), temp_bytes, ids,
                                                 ids_out.as<int32_t>(), rows_in.as<int32_t>(),
                                                 rows_out.as<int32_t>(), items, 0, end_bit,
                                                 stream));
  constexpr int V = 16 / sizeof(T);
  const T* d = static_cast<const T*>(dout);
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(n, 1 << 20));
  if (hidden % V == 0 && dev::aligned16(d)) {
    embedding_backward_segments_kernel<T, V><<<blocks, kThreads, 0, stream>>>(
        ids_out.as<int32_t>(), rows_out.as<int32_t>(), d, n, vocab, hidden, dtable);
  } else {
    embedding_backward_segments_kernel<T, 1><<<blocks, kThreads, 0, stream>>>(
        ids_out.as<int32_t>(), rows_out.as<int32_t>(), d, n, vocab, hidden, dtable);
  }
  check_launch("embedding_backward_segments_kernel");
}

}  // namespace

void embedding_forward(const int32_t* ids, const void* table, int64_t n, int64_t vocab,
                       int64_t hidden, DType dtype, void* out, cudaStream_t stream,
                       bool host_table) {
  if (n == 0 || hidden == 0) return;
  switch (dtype) {
    case DType::F32:
      return forward_typed<float>(ids, table, n, vocab, hidden, out, stream, host_table);
    case DType::BF16:
      return forward_typed<__nv_bfloat16>(ids, table, n, vocab, hidden, out, stream, host_table);
    default: OPD_FAIL(Unsupported, "CUDA embedding_forward for dtype ", dtype_name(dtype));
  }
}

void embedding_backward(const int32_t* ids, const void* dout, int64_t n, int64_t vocab,
                        int64_t hidden, DType dtype, float* dtable, cudaStream_t stream) {
  if (n == 0 || hidden == 0) return;
  switch (dtype) {
    case DType::F32: return backward_typed<float>(ids, dout, n, vocab, hidden, dtable, stream);
    case DType::BF16:
      return backward_typed<__nv_bfloat16>(ids, dout, n, vocab, hidden, dtable, stream);
    default: OPD_FAIL(Unsupported, "CUDA embedding_backward for dtype ", dtype_name(dtype));
  }
}

}  // namespace opd::cuda
