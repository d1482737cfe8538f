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

// A thread copies W consecutive elements of a row per chunk (grid-stride over the n_out x h / W
// chunks): 16-byte loads of the input when h % W == 0 and the buffers are 16-byte aligned (W =
// 16 / sizeof(Ti)), else W = 1; each element converted as to_f32 then from_f32<To> either way.
// A source row outside [0, n_in) (the dispatcher validated the map, so only -1 gets here) reads
// nothing and writes zeros: the kernel never dereferences an unchecked index.
template <typename Ti, typename To, int W>
__global__ void gather_rows_kernel(const Ti* in, int64_t n_in, const int32_t* rows, int64_t n_out,
                                   int64_t h, To* out) {
  const int64_t per_row = h / W, total = n_out * per_row;
  for (int64_t c = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x; c < total;
       c += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t i = c / per_row, col = (c % per_row) * W;
    const int64_t r = rows[i];
    dev::Pack<To, W> o;
    if (r >= 0 && r < n_in) {
      dev::Pack<Ti, W> v;
      v.load(in + r * h + col);
#pragma unroll
      for (int k = 0; k < W; ++k) o.f[k] = v.f[k];
    } else {
#pragma unroll
      for (int k = 0; k < W; ++k) o.f[k] = 0.0f;
    }
    o.store(out + i * h + col);
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
  constexpr int V = 16 / sizeof(Ti);
  const Ti* src = static_cast<const Ti*>(in);
  To* dst = static_cast<To*>(out);
  if (h % V == 0 && dev::aligned16(src) && dev::aligned16(dst)) {
    gather_rows_kernel<Ti, To, V><<<grid_for(n_out * (h / V), kThreads), kThreads, 0, stream>>>(
        src, n_in, rows, n_out, h, dst);
  } else {
    gather_rows_kernel<Ti, To, 1><<<grid_for(n_out * h, kThreads), kThreads, 0, stream>>>(
        src, n_in, rows, n_out, h, dst);
  }
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
