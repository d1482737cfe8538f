// Multi-tensor AdamW and two-stage deterministic gradient norm on CUDA (see adamw.h). Per
// element, in f32 and in torch.optim.AdamW's single-tensor order (aten CPU kernels):
//   g  = grad * coef                                   (clip_grad_norm_'s in-place scale)
//   p  = p * decay                                     (param.mul_(1 - lr*wd))
//   m  = |w| < 0.5 ? m + w*(g - m) : g - (g - m)*(1 - w),  w = 1 - beta1   (exp_avg.lerp_)
//   v  = v * beta2;  v = v + (1 - beta2) * g * g       (mul_ then addcmul_)
//   p  = p + (-step_size) * m / (sqrt(v) / bc2_sqrt + eps)   (addcdiv_)
// then the model copy = round(p). Each block owns one 64K-element chunk of one tensor.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstring>

#include "core/cuda/stream.h"
#include "kernels/cuda/adamw.h"
#include "kernels/cuda/common.cuh"

namespace opd::cuda {
namespace {

constexpr int64_t kChunk = 65536;
constexpr int kThreads = 512;

struct DeviceTensor {
  float* p;
  const float* g;
  float* m;
  float* v;
  void* model;
  int64_t n;
  int vec;  // 1: all pointers allow 4-wide accesses
};
struct Chunk {
  int32_t tensor;
  int32_t index;  // chunk number within the tensor
};

__global__ void __launch_bounds__(kThreads)
    sumsq_kernel(const DeviceTensor* tensors, const Chunk* chunks, float* partials) {
  const Chunk c = chunks[blockIdx.x];
  const DeviceTensor t = tensors[c.tensor];
  const int64_t begin = c.index * kChunk, end = min(t.n, begin + kChunk);
  float acc = 0;
  for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) acc += t.g[i] * t.g[i];
  acc = dev::block_sum<kThreads>(acc);
  if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}

// One block: thread k adds partials k, k + 1024, ... in f64, then a fixed tree.
__global__ void __launch_bounds__(1024)
    norm_finalize_kernel(const float* partials, int64_t n, double max_norm, double* norm,
                         float* coef) {
  __shared__ double s[1024];
  double acc = 0;
  for (int64_t i = threadIdx.x; i < n; i += 1024) acc += static_cast<double>(partials[i]);
  s[threadIdx.x] = acc;
  __syncthreads();
  for (int w = 512; w > 0; w >>= 1) {
    if (threadIdx.x < w) s[threadIdx.x] += s[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    const double total = sqrt(s[0]);
    *norm = total;
    float c = 1.0f;
    if (max_norm > 0) {
      // torch: clip_coef = max_norm / (total_norm + 1e-6) in f32, clamped at 1.
      c = static_cast<float>(max_norm) / (static_cast<float>(total) + 1e-6f);
      c = fminf(c, 1.0f);
    }
    *coef = c;
  }
}

__device__ __forceinline__ void adamw_element(float& p, float g, float& m, float& v,
                                              const AdamWScalars& s) {
  p = p * s.decay;
  const float w = s.lerp_weight;
  m = fabsf(w) < 0.5f ? m + w * (g - m) : g - (g - m) * (1.0f - w);
  v = v * s.beta2;
  v = v + s.one_minus_beta2 * g * g;
  const float denom = sqrtf(v) / s.bc2_sqrt + s.eps;
  p = p + s.neg_step_size * m / denom;
}

template <typename M>
__global__ void __launch_bounds__(kThreads)
    adamw_kernel(const DeviceTensor* tensors, const Chunk* chunks, AdamWScalars s,
                 const float* coef_ptr) {
  const Chunk c = chunks[blockIdx.x];
  const DeviceTensor t = tensors[c.tensor];
  const float coef = coef_ptr ? *coef_ptr : 1.0f;
  const int64_t begin = c.index * kChunk, end = min(t.n, begin + kChunk);
  M* model = static_cast<M*>(t.model);
  int64_t i = begin + 4 * threadIdx.x;
  if (t.vec) {
    for (; i + 3 < end; i += 4 * kThreads) {
      float4 p = *reinterpret_cast<const float4*>(t.p + i);
      const float4 g = *reinterpret_cast<const float4*>(t.g + i);
      float4 m = *reinterpret_cast<const float4*>(t.m + i);
      float4 v = *reinterpret_cast<const float4*>(t.v + i);
      adamw_element(p.x, g.x * coef, m.x, v.x, s);
      adamw_element(p.y, g.y * coef, m.y, v.y, s);
      adamw_element(p.z, g.z * coef, m.z, v.z, s);
      adamw_element(p.w, g.w * coef, m.w, v.w, s);
      *reinterpret_cast<float4*>(t.p + i) = p;
      *reinterpret_cast<float4*>(t.m + i) = m;
      *reinterpret_cast<float4*>(t.v + i) = v;
      if (model) {
        model[i] = dev::from_f32<M>(p.x);
        model[i + 1] = dev::from_f32<M>(p.y);
        model[i + 2] = dev::from_f32<M>(p.z);
        model[i + 3] = dev::from_f32<M>(p.w);
      }
    }
    // The tail of a tensor whose size is not a multiple of 4 (last chunk only).
    if (i < end) {
      for (int64_t j = i; j < end; ++j) {
        float p = t.p[j], m = t.m[j], v = t.v[j];
        adamw_element(p, t.g[j] * coef, m, v, s);
        t.p[j] = p, t.m[j] = m, t.v[j] = v;
        if (model) model[j] = dev::from_f32<M>(p);
      }
    }
  } else {
    for (int64_t j = begin + threadIdx.x; j < end; j += kThreads) {
      float p = t.p[j], m = t.m[j], v = t.v[j];
      adamw_element(p, t.g[j] * coef, m, v, s);
      t.p[j] = p, t.m[j] = m, t.v[j] = v;
      if (model) model[j] = dev::from_f32<M>(p);
    }
  }
}

}  // namespace

MultiTensorAdamW::MultiTensorAdamW(const std::vector<AdamWTensor>& tensors, DType model_dtype,
                                   cudaStream_t stream)
    : model_dtype_(model_dtype) {
  OPD_CHECK(model_dtype == DType::BF16 || model_dtype == DType::F32, InvalidArgument,
            "AdamW model copies must be bf16 or f32, got ", dtype_name(model_dtype));
  std::vector<DeviceTensor> host;
  std::vector<Chunk> chunks;
  for (const AdamWTensor& t : tensors) {
    const size_t model_align = model_dtype == DType::BF16 ? 8 : 16;
    const bool vec = dev::aligned16(t.param) && dev::aligned16(t.grad) &&
                     dev::aligned16(t.exp_avg) && dev::aligned16(t.exp_avg_sq) &&
                     (t.model == nullptr ||
                      reinterpret_cast<uintptr_t>(t.model) % model_align == 0);
    OPD_CHECK(host.size() < 0x7fffffff, Unsupported, "AdamW over too many tensors");
    const int32_t index = static_cast<int32_t>(host.size());
    host.push_back({t.param, t.grad, t.exp_avg, t.exp_avg_sq, t.model, t.n, vec ? 1 : 0});
    const int64_t n_chunks = (t.n + kChunk - 1) / kChunk;
    OPD_CHECK(n_chunks < 0x7fffffff, Unsupported, "AdamW tensor of ", t.n, " elements");
    for (int64_t c = 0; c < n_chunks; ++c) chunks.push_back({index, static_cast<int32_t>(c)});
  }
  chunks_ = static_cast<int64_t>(chunks.size());
  OPD_CHECK(chunks_ < 0x7fffffff, Unsupported, "AdamW over ", chunks_, " chunks");
  tensors_ = DeviceBuffer(std::max<size_t>(1, host.size()) * sizeof(DeviceTensor), stream);
  chunk_table_ = DeviceBuffer(std::max<size_t>(1, chunks.size()) * sizeof(Chunk), stream);
  partials_ = DeviceBuffer(std::max<size_t>(1, chunks.size()) * sizeof(float), stream);
  result_ = DeviceBuffer(16, stream);
  if (!host.empty()) {
    OPD_CUDA_CHECK(cudaMemcpyAsync(tensors_.get(), host.data(), host.size() * sizeof(DeviceTensor),
                                   cudaMemcpyHostToDevice, stream));
  }
  if (!chunks.empty()) {
    OPD_CUDA_CHECK(cudaMemcpyAsync(chunk_table_.get(), chunks.data(), chunks.size() * sizeof(Chunk),
                                   cudaMemcpyHostToDevice, stream));
  }
  // The host vectors die here: wait so the pageable copies have read them.
  OPD_CUDA_CHECK(cudaStreamSynchronize(stream));
}

void MultiTensorAdamW::grad_norm(double max_norm, cudaStream_t stream) {
  if (chunks_ > 0) {
    sumsq_kernel<<<static_cast<unsigned>(chunks_), kThreads, 0, stream>>>(
        tensors_.as<DeviceTensor>(), chunk_table_.as<Chunk>(), partials_.as<float>());
    check_launch("sumsq_kernel");
  }
  double* norm = result_.as<double>();
  float* coef = reinterpret_cast<float*>(norm + 1);
  norm_finalize_kernel<<<1, 1024, 0, stream>>>(partials_.as<float>(), chunks_, max_norm, norm, coef);
  check_launch("norm_finalize_kernel");
}

void MultiTensorAdamW::step(const AdamWScalars& s, bool use_clip, cudaStream_t stream) {
  if (chunks_ == 0) return;
  const float* coef = use_clip ? reinterpret_cast<const float*>(result_.as<double>() + 1) : nullptr;
  if (model_dtype_ == DType::BF16) {
    adamw_kernel<__nv_bfloat16><<<static_cast<unsigned>(chunks_), kThreads, 0, stream>>>(
        tensors_.as<DeviceTensor>(), chunk_table_.as<Chunk>(), s, coef);
  } else {
    adamw_kernel<float><<<static_cast<unsigned>(chunks_), kThreads, 0, stream>>>(
        tensors_.as<DeviceTensor>(), chunk_table_.as<Chunk>(), s, coef);
  }
  check_launch("adamw_kernel");
}

void MultiTensorAdamW::read_norm(double* norm, float* coef, cudaStream_t stream) const {
  unsigned char host[16];
  OPD_CUDA_CHECK(cudaMemcpyAsync(host, result_.get(), 16, cudaMemcpyDeviceToHost, stream));
  OPD_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::memcpy(norm, host, sizeof(double));
  std::memcpy(coef, host + sizeof(double), sizeof(float));
}

}  // namespace opd::cuda
