// Tensor-level routing of the paged KV cache ops (kernels/ops.h) to the CUDA kernels of
// paged_attention.cu: dtype/shape checks, then the index checks of the CPU op with the same
// messages (InvalidData naming the entry) before any kernel runs, so a rejected call writes
// nothing. Index tensors may live on the CPU (uploaded here) or on the GPU (read back once).
// The kernels guard every index again (they never fault on data).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/cuda/allocator.h"
#include "core/cuda/stream.h"
#include "core/tensor.h"
#include "kernels/cpu/cpu_ops.h"  // cpu::check_paged_indices: the CPU's checks and messages
#include "kernels/cuda/cuda_ops.h"

namespace opd::cuda {

namespace {

std::vector<int32_t> host_ints(const Tensor& t) {
  Tensor h = t.to(Device::CPU);
  const int32_t* p = h.data<int32_t>();
  return std::vector<int32_t>(p, p + h.numel());
}

// Device copy of an index tensor that is on the host (kept alive by the returned tensor).
Tensor on_device(const Tensor& t) { return t.device() == Device::CUDA ? t : t.to(Device::CUDA); }

void expect_float(const char* op, const char* name, const Tensor& t, DType dt) {
  OPD_CHECK(t.device() == Device::CUDA && t.dtype() == dt, InvalidArgument, op, ": ", name,
            " must be a CUDA ", dtype_name(dt), " tensor, got ", t.describe());
}

}  // namespace

void kv_cache_store_cuda(const Tensor& k, const Tensor& v, const Tensor& slot_mapping,
                         Tensor& k_cache, Tensor& v_cache) {
  const char* op = "kv_cache_store";
  const DType dt = k.dtype();
  OPD_CHECK(dt == DType::BF16 || dt == DType::F32, Unsupported, op, " on CUDA: dtype ",
            dtype_name(dt), " (bf16 or f32)");
  for (auto [name, t] : {std::pair<const char*, const Tensor*>{"k", &k}, {"v", &v},
                         {"k_cache", &k_cache}, {"v_cache", &v_cache}})
    expect_float(op, name, *t, dt);
  OPD_CHECK(k_cache.writable() && v_cache.writable(), InvalidArgument, op, ": caches are read-only");
  const int64_t n = k.dim(0), num_blocks = k_cache.dim(0), bs = k_cache.dim(1);
  const int64_t slots = num_blocks * bs;
  Tensor slot_dev = on_device(slot_mapping);
  // One pass on the device (first bad row, its value), the CPU's message, nothing written.
  IndexCheckResult r = check_indices(slot_dev.data<int32_t>(), n, IndexRule::InRange, slots,
                                     current_stream());
  OPD_CHECK(r.first_bad_row < 0, InvalidData, "kv_cache_store: slot ", r.value, " at row ",
            r.first_bad_row, " is outside the cache [0, ", slots, ") (", num_blocks,
            " blocks of ", bs, ")");
  PagedStoreArgs a;
  a.k = k.raw();
  a.v = v.raw();
  a.slot_mapping = slot_dev.data<int32_t>();
  a.n = n;
  a.num_blocks = num_blocks;
  a.block_size = bs;
  a.hkv = k.dim(1);
  a.head_dim = k.dim(2);
  a.dtype = dt;
  a.k_cache = k_cache.raw();
  a.v_cache = v_cache.raw();
  kv_cache_store(a, current_stream());
}

void paged_attention_cuda(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                          const Tensor& cu_seqlens_q, const Tensor& seq_lens,
                          const Tensor& block_tables, double scale, Tensor& out) {
  const char* op = "paged_attention";
  const DType dt = q.dtype();
  OPD_CHECK(dt == DType::BF16 || dt == DType::F32, Unsupported, op, " on CUDA: dtype ",
            dtype_name(dt), " (bf16 or f32)");
  for (auto [name, t] : {std::pair<const char*, const Tensor*>{"q", &q}, {"k_cache", &k_cache},
                         {"v_cache", &v_cache}, {"out", &out}})
    expect_float(op, name, *t, dt);
  OPD_CHECK(out.writable(), InvalidArgument, op, ": out is read-only");
  const int64_t n = q.dim(0), hq = q.dim(1), d = q.dim(2);
  const int64_t num_blocks = k_cache.dim(0), bs = k_cache.dim(1), hkv = k_cache.dim(2);
  const int64_t batch = cu_seqlens_q.dim(0) - 1, max_blocks = block_tables.dim(1);
  OPD_CHECK(paged_attention_supports(dt, d), Unsupported, op, " on CUDA: head_dim ", d,
            " (8, 16, 32, 64, 128 or 256)");

  const std::vector<int32_t> cu = host_ints(cu_seqlens_q), lens = host_ints(seq_lens),
                             tables = host_ints(block_tables);
  cpu::check_paged_indices(cu.data(), lens.data(), tables.data(), batch, n, num_blocks, bs,
                           max_blocks);
  int64_t max_q = 1, max_len = 1;
  for (int64_t b = 0; b < batch; ++b) {
    max_q = std::max<int64_t>(max_q, cu[b + 1] - cu[b]);
    max_len = std::max<int64_t>(max_len, lens[b]);
  }
  const Tensor cu_dev = on_device(cu_seqlens_q), lens_dev = on_device(seq_lens),
               tables_dev = on_device(block_tables);
  PagedAttentionArgs a;
  a.q = q.raw();
  a.k_cache = k_cache.raw();
  a.v_cache = v_cache.raw();
  a.out = out.raw();
  a.cu_seqlens_q = cu_dev.data<int32_t>();
  a.seq_lens = lens_dev.data<int32_t>();
  a.block_tables = tables_dev.data<int32_t>();
  a.batch = batch;
  a.total_q = n;
  a.hq = hq;
  a.hkv = hkv;
  a.head_dim = d;
  a.num_blocks = num_blocks;
  a.block_size = bs;
  a.max_blocks = max_blocks;
  a.max_q_len = max_q;
  a.max_seq_len = max_len;
  a.scale = scale;
  a.dtype = dt;
  const PagedAttentionLaunch l = paged_attention_launch(a);
  cudaStream_t stream = current_stream();
  DeviceBuffer workspace(l.workspace_bytes, stream);
  paged_attention(a, l.workspace_bytes ? workspace.get() : nullptr, stream);
}

}  // namespace opd::cuda
