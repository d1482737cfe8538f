// Host side of the CUDA attention (FlashAttention-2, Dao 2023): the AttentionPlan (work tiles
// of a packed batch, built from cu_seqlens on the host) and the Tensor-level routing that
// kernels/ops.cpp calls for CUDA tensors. Kernels are in attention_fwd.cu / attention_bwd.cu.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/cuda/stream.h"
#include "core/tensor.h"
#include "kernels/cpu/cpu_ops.h"  // cpu::check_cu_seqlens: the same validation and messages
#include "kernels/cuda/cuda_ops.h"

namespace opd::cuda {

AttentionPlan::AttentionPlan(const int32_t* cu_seqlens_host, int64_t batch, int64_t total_rows,
                             cudaStream_t stream)
    : batch_(batch), total_rows_(total_rows), total_k_rows_(total_rows), stream_(stream) {
  OPD_CHECK(batch >= 0 && total_rows >= 0, InvalidArgument, "AttentionPlan: batch ", batch,
            " and total_rows ", total_rows, " must be >= 0");
  cpu::check_cu_seqlens("attention (CUDA plan)", cu_seqlens_host, batch, total_rows);
  build(cu_seqlens_host, nullptr, batch, total_rows, total_rows);
}

AttentionPlan::AttentionPlan(const int32_t* cu_seqlens_q_host, const int32_t* cu_seqlens_k_host,
                             int64_t batch, int64_t total_q_rows, int64_t total_k_rows,
                             cudaStream_t stream)
    : batch_(batch), total_rows_(total_q_rows), total_k_rows_(total_k_rows), stream_(stream) {
  OPD_CHECK(batch >= 0 && total_q_rows >= 0 && total_k_rows >= 0, InvalidArgument,
            "AttentionPlan: batch ", batch, ", total_q_rows ", total_q_rows, " and total_k_rows ",
            total_k_rows, " must be >= 0");
  OPD_CHECK(cu_seqlens_k_host != nullptr, InvalidArgument, "AttentionPlan: cu_seqlens_k is null");
  cpu::check_cu_seqlens_context("attention with context (CUDA plan)", cu_seqlens_q_host,
                                cu_seqlens_k_host, batch, total_q_rows, total_k_rows);
  build(cu_seqlens_q_host, cu_seqlens_k_host, batch, total_q_rows, total_k_rows);
}

// cu_k == nullptr: the square plan (keys are the query rows), laid out exactly as before the
// context plans existed. Otherwise the same tiles (over query rows) plus, in q_tiles() order,
// each tile's key range, then cu_k.
void AttentionPlan::build(const int32_t* cu_q, const int32_t* cu_k, int64_t batch,
                          int64_t total_q, int64_t total_k) {
  OPD_CHECK(total_q < (int64_t{1} << 31) && total_k < (int64_t{1} << 31), Unsupported,
            "CUDA attention: ", std::max(total_q, total_k),
            " packed rows exceed the int32 row indices of the kernels");
  struct Entry {
    int32_t start, len, block, work_q, work_k, k_start, offset;
  };
  std::vector<Entry> entries;
  constexpr int64_t kB = kTileRows;
  for (int64_t b = 0; b < batch; ++b) {
    const int32_t start = cu_q[b], len = cu_q[b + 1] - start;
    const int32_t k_start = cu_k ? cu_k[b] : start;
    const int32_t offset = cu_k ? (cu_k[b + 1] - cu_k[b]) - len : 0;  // >= 0 (validated)
    max_seqlen_ = std::max<int64_t>(max_seqlen_, len);
    for (int32_t blk = 0; static_cast<int64_t>(blk) * kB < len; ++blk) {
      const int32_t first = static_cast<int32_t>(blk * kB);
      const int32_t last = static_cast<int32_t>(std::min<int64_t>(len, first + kB));
      // Work of a query block ~ keys it visits (offset + last); of a key block ~ queries after it.
      entries.push_back({start, len, blk, offset + last, len - first, k_start, offset});
    }
  }
  num_tiles_ = static_cast<int64_t>(entries.size());
  const int64_t ctx = cu_k ? 2 * num_tiles_ + batch + 1 : 0;
  std::vector<int32_t> host(static_cast<size_t>(8 * num_tiles_ + batch + 1 + ctx));
  auto fill = [&](int64_t offset, auto key, bool ranges) {
    std::vector<Entry> sorted = entries;
    // Stable: equal-work tiles keep sequence order, so the schedule is a pure function of
    // cu_seqlens (results never depend on it: each tile is computed independently).
    std::stable_sort(sorted.begin(), sorted.end(),
                     [&](const Entry& a, const Entry& b) { return key(a) > key(b); });
    for (int64_t i = 0; i < num_tiles_; ++i) {
      int32_t* t = host.data() + offset + 4 * i;
      t[0] = sorted[i].start;
      t[1] = sorted[i].len;
      t[2] = sorted[i].block;
      t[3] = 0;
      if (ranges) {  // the key range of q tile i, in the same order
        int32_t* r = host.data() + 8 * num_tiles_ + batch + 1 + 2 * i;
        r[0] = sorted[i].k_start;
        r[1] = sorted[i].offset;
      }
    }
  };
  fill(0, [](const Entry& e) { return e.work_q; }, cu_k != nullptr);
  fill(4 * num_tiles_, [](const Entry& e) { return e.work_k; }, false);
  std::copy(cu_q, cu_q + batch + 1, host.data() + 8 * num_tiles_);
  if (cu_k) std::copy(cu_k, cu_k + batch + 1, host.data() + 10 * num_tiles_ + batch + 1);

  const size_t bytes = host.size() * sizeof(int32_t);
  OPD_CUDA_CHECK(cudaMallocAsync(&buffer_, bytes, stream_));
  // Pageable source: the call returns once the data is staged, so `host` may go away.
  cudaError_t status = cudaMemcpyAsync(buffer_, host.data(), bytes, cudaMemcpyHostToDevice, stream_);
  if (status != cudaSuccess) {
    (void)cudaFreeAsync(buffer_, stream_);
    buffer_ = nullptr;
    OPD_CUDA_CHECK(status);
  }
  const int32_t* base = static_cast<const int32_t*>(buffer_);
  q_tiles_ = base;
  k_tiles_ = base + 4 * num_tiles_;
  cu_ = base + 8 * num_tiles_;
  if (cu_k) {
    key_ranges_ = base + 8 * num_tiles_ + batch + 1;
    cu_k_ = base + 10 * num_tiles_ + batch + 1;
  }
}

AttentionPlan::~AttentionPlan() {
  if (buffer_) (void)cudaFreeAsync(buffer_, stream_);  // after the kernels queued on stream_
}

namespace {

// cu_seqlens as host ints (one synchronizing device-to-host copy when it lives on the GPU).
std::vector<int32_t> host_cu_seqlens(const char* op, const Tensor& cu_seqlens) {
  OPD_CHECK(cu_seqlens.dtype() == DType::I32 && cu_seqlens.ndim() == 1 && cu_seqlens.numel() >= 1,
            InvalidArgument, op, ": cu_seqlens must be i32 [B + 1], got ",
            cu_seqlens.describe());
  Tensor host = cu_seqlens.to(Device::CPU);
  const int32_t* p = host.data<int32_t>();
  return std::vector<int32_t>(p, p + host.numel());
}

// Float tensors share one dtype (f32 or bf16) and live on the GPU; lse is f32.
DType float_dtype(const char* op, std::initializer_list<std::pair<const char*, const Tensor*>> ts,
                  const Tensor& lse) {
  DType dt = ts.begin()->second->dtype();
  OPD_CHECK(dt == DType::F32 || dt == DType::BF16, Unsupported, op, " on CUDA: dtype ",
            dtype_name(dt), " (f32 or bf16)");
  for (const auto& [name, t] : ts) {
    OPD_CHECK(t->device() == Device::CUDA, InvalidArgument, op, ": ", name,
              " must be a CUDA tensor, got ", t->describe());
    OPD_CHECK(t->dtype() == dt, InvalidArgument, op, ": ", name, " is ", t->describe(),
              " but q is ", dtype_name(dt));
  }
  OPD_CHECK(lse.device() == Device::CUDA && lse.dtype() == DType::F32, InvalidArgument, op,
            ": lse must be a CUDA f32 tensor, got ", lse.describe());
  return dt;
}

void expect_writable(const char* op, const char* name, const Tensor& t) {
  OPD_CHECK(t.writable(), InvalidArgument, op, ": ", name, " is read-only");
}

void expect_shape(const char* op, const char* name, const Tensor& t, const Shape& want) {
  OPD_CHECK(t.shape() == want, InvalidArgument, op, ": ", name, " must have shape ",
            shape_str(want), ", got ", t.describe());
}

struct Dims {
  int64_t n, hq, hkv, d;
};

Dims dims(const char* op, const Tensor& q, const Tensor& k, const Tensor& v, double scale) {
  OPD_CHECK(q.ndim() == 3 && k.ndim() == 3, InvalidArgument, op, ": q and k must be 3-d, got ",
            q.describe(), " and ", k.describe());
  Dims a{q.dim(0), q.dim(1), k.dim(1), q.dim(2)};
  expect_shape(op, "k", k, {a.n, a.hkv, a.d});
  expect_shape(op, "v", v, {a.n, a.hkv, a.d});
  OPD_CHECK(a.hkv >= 1 && a.hq % a.hkv == 0, InvalidArgument, op, ": query heads ", a.hq,
            " must be a multiple of kv heads ", a.hkv);
  OPD_CHECK(std::isfinite(scale), InvalidArgument, op, ": scale must be finite, got ", scale);
  return a;
}

}  // namespace

void attention_forward_cuda(const Tensor& q, const Tensor& k, const Tensor& v,
                            const Tensor& cu_seqlens, double scale, Tensor& out, Tensor& lse) {
  const char* op = "attention_forward";
  Dims a = dims(op, q, k, v, scale);
  expect_shape(op, "out", out, {a.n, a.hq, a.d});
  expect_shape(op, "lse", lse, {a.n, a.hq});
  DType dt = float_dtype(op, {{"q", &q}, {"k", &k}, {"v", &v}, {"out", &out}}, lse);
  expect_writable(op, "out", out);
  expect_writable(op, "lse", lse);
  std::vector<int32_t> cu = host_cu_seqlens(op, cu_seqlens);
  AttentionPlan plan(cu.data(), static_cast<int64_t>(cu.size()) - 1, a.n, nullptr);
  attention_forward(plan, q.raw(), k.raw(), v.raw(), a.hq, a.hkv, a.d, scale, dt, out.raw(),
                    lse.data<float>(), nullptr);
}

void attention_backward_cuda(const Tensor& dout, const Tensor& q, const Tensor& k,
                             const Tensor& v, const Tensor& out, const Tensor& lse,
                             const Tensor& cu_seqlens, double scale, Tensor& dq, Tensor& dk,
                             Tensor& dv) {
  const char* op = "attention_backward";
  Dims a = dims(op, q, k, v, scale);
  for (auto [name, t] : {std::pair<const char*, const Tensor*>{"dout", &dout}, {"out", &out},
                         {"dq", &dq}}) {
    expect_shape(op, name, *t, {a.n, a.hq, a.d});
  }
  expect_shape(op, "dk", dk, {a.n, a.hkv, a.d});
  expect_shape(op, "dv", dv, {a.n, a.hkv, a.d});
  expect_shape(op, "lse", lse, {a.n, a.hq});
  DType dt = float_dtype(op, {{"q", &q}, {"k", &k}, {"v", &v}, {"dout", &dout}, {"out", &out},
                              {"dq", &dq}, {"dk", &dk}, {"dv", &dv}},
                         lse);
  expect_writable(op, "dq", dq);
  expect_writable(op, "dk", dk);
  expect_writable(op, "dv", dv);
  std::vector<int32_t> cu = host_cu_seqlens(op, cu_seqlens);
  AttentionPlan plan(cu.data(), static_cast<int64_t>(cu.size()) - 1, a.n, nullptr);
  attention_backward(plan, dout.raw(), q.raw(), k.raw(), v.raw(), out.raw(), lse.data<float>(),
                     a.hq, a.hkv, a.d, scale, dt, dq.raw(), dk.raw(), dv.raw(), nullptr);
}

}  // namespace opd::cuda
