// Tensor-level dispatch of the paged-KV-cache ops of kernels/ops.h (kv_cache_store,
// paged_attention): validates devices, dtypes and shapes (errors name the op and every
// tensor), then routes CPU f32/f64 tensors to kernels/cpu/paged_attention.cpp and CUDA f32/bf16 tensors
// to kernels/cuda/paged_dispatch.cpp. Kept apart from ops.cpp: the generation ops in one place.
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/ops.h"
#ifdef OPD_WITH_CUDA
#include "kernels/cuda/cuda_ops.h"  // kv_cache_store_cuda, paged_attention_cuda
#endif

namespace opd::ops {

namespace {

using Named = std::pair<const char*, const Tensor*>;

std::string describe_all(const std::vector<Named>& args) {
  std::string s = "(";
  for (size_t i = 0; i < args.size(); ++i)
    s += cat(i ? ", " : "", args[i].first, " ", args[i].second->describe());
  return s + ")";
}

// Common checks: all defined, floats share one device and dtype (CPU: f32 or f64; CUDA: f32 or
// bf16, index tensors on either device), index tensors i32, outputs writable. Returns the
// float dtype; *device is where the floats live.
DType check_paged_op(const char* op, const std::vector<Named>& floats,
                     const std::vector<Named>& indices, const std::vector<Named>& outputs,
                     Device* device) {
  std::vector<Named> all = floats;
  all.insert(all.end(), indices.begin(), indices.end());
  for (const Named& a : all)
    OPD_CHECK(a.second->defined(), InvalidArgument, op, ": tensor ", a.first, " is undefined");
  *device = floats.front().second->device();
  for (const Named& a : floats) {
    if (a.second->device() != *device)
      OPD_FAIL(InvalidArgument, op, ": float tensors must be on one device ", describe_all(all));
  }
  for (const Named& a : indices) {
    if (*device == Device::CPU && a.second->device() != Device::CPU)
      OPD_FAIL(InvalidArgument, op, ": index tensors of a CPU op must be on the CPU ",
               describe_all(all));
  }
  const DType dtype = floats.front().second->dtype();
  if (*device == Device::CUDA) {
#ifndef OPD_WITH_CUDA
    OPD_FAIL(Unsupported, op, " on CUDA: this build has no CUDA backend");
#endif
    if (dtype != DType::F32 && dtype != DType::BF16)
      OPD_FAIL(Unsupported, op, ": dtype ", dtype_name(dtype),
               " on CUDA is not implemented (f32 or bf16) ", describe_all(all));
  } else if (dtype != DType::F32 && dtype != DType::F64)
    OPD_FAIL(Unsupported, op, ": dtype ", dtype_name(dtype),
             " on the CPU is not implemented (f32 or f64) ", describe_all(all));
  for (const Named& a : floats) {
    if (a.second->dtype() != dtype)
      OPD_FAIL(InvalidArgument, op, ": float tensors must share one dtype, but ", a.first, " is ",
               dtype_name(a.second->dtype()), " ", describe_all(all));
  }
  for (const Named& a : indices) {
    if (a.second->dtype() != DType::I32)
      OPD_FAIL(InvalidArgument, op, ": ", a.first, " must be i32 ", describe_all(all));
  }
  for (const Named& a : outputs) {
    if (!a.second->writable()) OPD_FAIL(InvalidArgument, op, ": ", a.first, " is read-only");
  }
  return dtype;
}

void expect_shape(const char* op, const char* name, const Tensor& t, const Shape& want) {
  if (t.shape() != want)
    OPD_FAIL(InvalidArgument, op, ": ", name, " must have shape ", shape_str(want), ", got ",
             shape_str(t.shape()));
}

void expect_ndim(const char* op, const char* name, const Tensor& t, int ndim) {
  if (t.ndim() != ndim)
    OPD_FAIL(InvalidArgument, op, ": ", name, " must be ", ndim, "-d, got ",
             shape_str(t.shape()));
}

}  // namespace

void kv_cache_store(const Tensor& k, const Tensor& v, const Tensor& slot_mapping, Tensor& k_cache,
                    Tensor& v_cache) {
  const char* op = "kv_cache_store";
  Device device;
  DType dtype = check_paged_op(op, {{"k", &k}, {"v", &v}, {"k_cache", &k_cache}, {"v_cache", &v_cache}},
                               {{"slot_mapping", &slot_mapping}},
                               {{"k_cache", &k_cache}, {"v_cache", &v_cache}}, &device);
  expect_ndim(op, "k", k, 3);
  expect_ndim(op, "k_cache", k_cache, 4);
  const int64_t n = k.dim(0), hkv = k.dim(1), d = k.dim(2);
  const int64_t num_blocks = k_cache.dim(0), bs = k_cache.dim(1);
  expect_shape(op, "v", v, {n, hkv, d});
  expect_shape(op, "slot_mapping", slot_mapping, {n});
  expect_shape(op, "k_cache", k_cache, {num_blocks, bs, hkv, d});
  expect_shape(op, "v_cache", v_cache, {num_blocks, bs, hkv, d});
  if (device == Device::CUDA) {
#ifdef OPD_WITH_CUDA
    cuda::kv_cache_store_cuda(k, v, slot_mapping, k_cache, v_cache);
#endif
    return;
  }
  const int32_t* slots = slot_mapping.data<int32_t>();
  if (dtype == DType::F32) {
    cpu::kv_cache_store(k.data<float>(), v.data<float>(), slots, n, num_blocks, bs, hkv, d,
                        k_cache.data<float>(), v_cache.data<float>());
  } else {
    cpu::kv_cache_store(k.data<double>(), v.data<double>(), slots, n, num_blocks, bs, hkv, d,
                        k_cache.data<double>(), v_cache.data<double>());
  }
}

void paged_attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                     const Tensor& cu_seqlens_q, const Tensor& seq_lens,
                     const Tensor& block_tables, double scale, Tensor& out) {
  const char* op = "paged_attention";
  Device device;
  DType dtype = check_paged_op(
      op, {{"q", &q}, {"k_cache", &k_cache}, {"v_cache", &v_cache}, {"out", &out}},
      {{"cu_seqlens_q", &cu_seqlens_q}, {"seq_lens", &seq_lens}, {"block_tables", &block_tables}},
      {{"out", &out}}, &device);
  expect_ndim(op, "q", q, 3);
  expect_ndim(op, "k_cache", k_cache, 4);
  expect_ndim(op, "cu_seqlens_q", cu_seqlens_q, 1);
  expect_ndim(op, "block_tables", block_tables, 2);
  const int64_t n = q.dim(0), hq = q.dim(1), d = q.dim(2);
  const int64_t num_blocks = k_cache.dim(0), bs = k_cache.dim(1), hkv = k_cache.dim(2);
  const int64_t batch = cu_seqlens_q.dim(0) - 1, max_blocks = block_tables.dim(1);
  OPD_CHECK(batch >= 0, InvalidArgument, op, ": cu_seqlens_q must have B + 1 >= 1 entries");
  OPD_CHECK(hkv >= 1 && hq % hkv == 0, InvalidArgument, op, ": query heads ", hq,
            " must be a multiple of kv heads ", hkv);
  OPD_CHECK(std::isfinite(scale), InvalidArgument, op, ": scale must be finite, got ", scale);
  expect_shape(op, "k_cache", k_cache, {num_blocks, bs, hkv, d});
  expect_shape(op, "v_cache", v_cache, {num_blocks, bs, hkv, d});
  expect_shape(op, "seq_lens", seq_lens, {batch});
  expect_shape(op, "block_tables", block_tables, {batch, max_blocks});
  expect_shape(op, "out", out, {n, hq, d});
  if (device == Device::CUDA) {
#ifdef OPD_WITH_CUDA
    cuda::paged_attention_cuda(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale,
                               out);
#endif
    return;
  }
  const int32_t* cu = cu_seqlens_q.data<int32_t>();
  const int32_t* lens = seq_lens.data<int32_t>();
  const int32_t* tables = block_tables.data<int32_t>();
  if (dtype == DType::F32) {
    cpu::paged_attention(q.data<float>(), k_cache.data<float>(), v_cache.data<float>(), cu, lens,
                         tables, batch, n, hq, hkv, d, num_blocks, bs, max_blocks, scale,
                         out.data<float>());
  } else {
    cpu::paged_attention(q.data<double>(), k_cache.data<double>(), v_cache.data<double>(), cu,
                         lens, tables, batch, n, hq, hkv, d, num_blocks, bs, max_blocks, scale,
                         out.data<double>());
  }
}

}  // namespace opd::ops
