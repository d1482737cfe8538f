// Row gather with zero rows and dtype conversion on CUDA (kernels/ops.h: gather_rows, convert):
// out[i, :] = rows[i] == -1 ? 0 : in[rows[i], :], converted from in's dtype to out's (f32 or
// bf16; f32 -> bf16 rounds to nearest even, as the host conversion does). The model uses it to
// pick the loss rows of a packed batch and to scatter their f32 gradient back as bf16 rows.
// Memory-bound: one read of the used input rows, one write of the output.
#include <cuda_bf16.h>

#include <cstdint>

#include "core/cuda/stream.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_ops.h"

namespace opd::cuda {
namespace {

constexpr int kThreads = 256;

// Block (x, y) covers columns [x * 256, ...) of rows y, y + gridDim.y, ... A source row outside
// [0, n_in) (the dispatcher validated the map, so only -1 gets here) reads nothing and writes
// zeros: the kernel never dereferences an unchecked index.
template <typename Ti, typename To>
__global__ void gather_rows_kernel(const Ti* in, int64_t n_in, const int32_t* rows, int64_t n_out,
                                   int64_t h, To* out) {
  const int64_t col = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x;
  if (col >= h) return;
  for (int64_t i = blockIdx.y; i < n_out; i += gridDim.y) {
    const int64_t r = rows[i];
    const float v = (r >= 0 && r < n_in) ? dev::to_f32(in[r * h + col]) : 0.0f;
    out[i * h + col] = dev::from_f32<To>(v);
  }
}

template <typename Ti, typename To>
__global__ void convert_kernel(const Ti* in, int64_t n, To* out) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * kThreads)
    out[i] = dev::from_f32<To>(dev::to_f32(in[i]));
}

template <typename Ti, typename To>
void gather_typed(const void* in, int64_t n_in, const int32_t* rows, int64_t n_out, int64_t h,
                  void* out, cudaStream_t stream) {
  const unsigned col_blocks = static_cast<unsigned>((h + kThreads - 1) / kThreads);
  const unsigned row_blocks = static_cast<unsigned>(n_out < 65535 ? n_out : 65535);
  gather_rows_kernel<Ti, To><<<dim3(col_blocks, row_blocks), kThreads, 0, stream>>>(
      static_cast<const Ti*>(in), n_in, rows, n_out, h, static_cast<To*>(out));
  check_launch("gather_rows_kernel");
}

template <typename Ti, typename To>
void convert_typed(const void* in, int64_t n, void* out, cudaStream_t stream) {
  convert_kernel<Ti, To><<<grid_for(n, kThreads), kThreads, 0, stream>>>(
      static_cast<const Ti*>(in), n, static_cast<To*>(out));
  check_launch("convert_kernel");
}

bool float_storage(DType dt) { return dt == DType::F32 || dt == DType::BF16; }

}  // namespace

void gather_rows(const void* in, DType in_dtype, int64_t n_in, const int32_t* rows, int64_t n_out,
                 int64_t h, void* out, DType out_dtype, cudaStream_t stream) {
  if (n_out == 0 || h == 0) return;
  OPD_CHECK(float_storage(in_dtype) && float_storage(out_dtype), Unsupported,
            "CUDA gather_rows ", dtype_name(in_dtype), " -> ", dtype_name(out_dtype));
  const bool in32 = in_dtype == DType::F32, out32 = out_dtype == DType::F32;
  if (in32 && out32) return gather_typed<float, float>(in, n_in, rows, n_out, h, out, stream);
  if (in32) return gather_typed<float, __nv_bfloat16>(in, n_in, rows, n_out, h, out, stream);
  if (out32) return gather_typed<__nv_bfloat16, float>(in, n_in, rows, n_out, h, out, stream);
  gather_typed<__nv_bfloat16, __nv_bfloat16>(in, n_in, rows, n_out, h, out, stream);
}

void convert(const void* in, DType in_dtype, int64_t n, void* out, DType out_dtype,
             cudaStream_t stream) {
  if (n == 0) return;
  OPD_CHECK(float_storage(in_dtype) && float_storage(out_dtype), Unsupported, "CUDA convert ",
            dtype_name(in_dtype), " -> ", dtype_name(out_dtype));
  const bool in32 = in_dtype == DType::F32, out32 = out_dtype == DType::F32;
  if (in32 && out32) return convert_typed<float, float>(in, n, out, stream);
  if (in32) return convert_typed<float, __nv_bfloat16>(in, n, out, stream);
  if (out32) return convert_typed<__nv_bfloat16, float>(in, n, out, stream);
  convert_typed<__nv_bfloat16, __nv_bfloat16>(in, n, out, stream);
}

}  // namespace opd::cuda
