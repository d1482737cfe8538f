// Tiled lm_head top-K with online log-sum-exp (formulas and memory in topk_lm_head.h).
#include "teacher/topk_lm_head.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

#include "core/error.h"
#include "core/philox.h"
#include "core/thread_pool.h"
#include "kernels/ops.h"
#ifdef OPD_WITH_CUDA
#include <cuda_runtime_api.h>

#include "core/cuda/allocator.h"        // DeviceBuffer, current_stream
#include "core/cuda/stream.h"           // OPD_CUDA_CHECK
#include "kernels/cuda/cuda_ops.h"      // check_indices
#include "teacher/topk_lm_head_cuda.h"  // the kernels
#endif

namespace opd {

namespace {

struct Entry {
  float z;
  int32_t id;
};
// a ranks before b: larger logit, ties by smaller id (the ordering rule of teacher/scorer.h).
inline bool better(const Entry& a, const Entry& b) {
  return a.z > b.z || (a.z == b.z && a.id < b.id);
}

struct RowState {
  double m = -std::numeric_limits<double>::infinity();  // running max of z / T
  double s = 0;                                          // sum exp(z / T - m)
  float z_actual = std::numeric_limits<float>::quiet_NaN();
  double best_sample = -std::numeric_limits<double>::infinity();
  int32_t sampled = -1;
  float z_sampled = 0;
  int32_t bad_id = -1;  // first id with a non-finite logit
};

}  // namespace

int64_t topk_lm_head_scratch_bytes(int64_t rows, int64_t vocab, int64_t vocab_tile,
                                   int64_t row_chunk) {
  return std::min(rows, row_chunk) * std::min(vocab_tile, vocab) * 4;
}

TopKLmHeadDeviceResult topk_lm_head_device(const Tensor& hidden, const Tensor& lm_head,
                                           const Tensor& actual, int64_t k, double temperature,
                                           bool want_ranks, int64_t vocab_tile,
                                           int64_t row_chunk) {
#ifndef OPD_WITH_CUDA
  OPD_FAIL(Unsupported, "topk_lm_head on CUDA: this build has no CUDA backend");
#else
  const DType dt = hidden.dtype();
  OPD_CHECK(hidden.defined() && lm_head.defined() && hidden.device() == Device::CUDA &&
                lm_head.device() == Device::CUDA && (dt == DType::BF16 || dt == DType::F32) &&
                lm_head.dtype() == dt && hidden.ndim() == 2 && lm_head.ndim() == 2 &&
                hidden.dim(1) == lm_head.dim(1),
            InvalidArgument, "topk_lm_head on CUDA: hidden ", hidden.describe(), " and lm_head ",
            lm_head.describe(), " must be CUDA [N, H] and [V, H] of one dtype (bf16 or f32)");
  const int64_t N = hidden.dim(0), V = lm_head.dim(0);
  OPD_CHECK(k >= 0 && k <= V, InvalidArgument, "topk_lm_head: k = ", k, " is outside [0, ", V, "]");
  OPD_CHECK(k <= cuda::kTopKLmHeadMaxK, Unsupported, "topk_lm_head on CUDA: k = ", k,
            " exceeds ", cuda::kTopKLmHeadMaxK);
  OPD_CHECK(std::isfinite(temperature) && temperature > 0, InvalidArgument,
            "topk_lm_head: temperature ", temperature, " must be finite and > 0");
  OPD_CHECK(vocab_tile > 0 && row_chunk > 0, InvalidArgument, "topk_lm_head: vocab_tile ",
            vocab_tile, " and row_chunk ", row_chunk, " must be > 0");
  cudaStream_t stream = cuda::current_stream();
  Tensor actual_dev;
  if (actual.defined()) {
    OPD_CHECK(actual.dtype() == DType::I32 && actual.ndim() == 1 && actual.dim(0) == N,
              InvalidArgument, "topk_lm_head: actual must be i32 [", N, "], got ",
              actual.describe());
    actual_dev = actual.device() == Device::CUDA ? actual : actual.to(Device::CUDA);
    const cuda::IndexCheckResult r = cuda::check_indices(
        actual_dev.data<int32_t>(), N, cuda::IndexRule::InRangeOrNone, V, stream);
    OPD_CHECK(r.first_bad_row < 0, InvalidData, "topk_lm_head: row ", r.first_bad_row,
              ": actual token id ", r.value, " is outside the vocabulary [0, ", V, ")");
  }
  TopKLmHeadDeviceResult out;
  out.ids = Tensor::empty({N, k}, DType::I32, Device::CUDA);
  out.logprobs = Tensor::empty({N, k}, DType::F32, Device::CUDA);
  out.actual_logprobs = Tensor::empty({N}, DType::F32, Device::CUDA);
  if (want_ranks) out.actual_ranks = Tensor::empty({N}, DType::I32, Device::CUDA);
  if (N == 0) return out;
  const size_t ws_bytes = cuda::topk_lm_head_cuda_workspace_bytes(N, V, k, vocab_tile, row_chunk);
  cuda::DeviceBuffer workspace(ws_bytes, stream);
  cuda::DeviceBuffer flags(3 * sizeof(unsigned), stream);
  OPD_CUDA_CHECK(cudaMemsetAsync(flags.get(), 0xff, 3 * sizeof(unsigned), stream));
  cuda::TopKLmHeadCudaArgs a;
  a.hidden = hidden.raw();
  a.lm_head = lm_head.raw();
  a.dtype = dt;
  a.rows = N;
  a.hidden_dim = hidden.dim(1);
  a.vocab = V;
  a.actual = actual_dev.defined() ? actual_dev.data<int32_t>() : nullptr;
  a.k = k;
  a.temperature = temperature;
  a.want_ranks = want_ranks;
  a.vocab_tile = vocab_tile;
  a.row_chunk = row_chunk;
  a.ids = k > 0 ? out.ids.data<int32_t>() : nullptr;
  a.logprobs = k > 0 ? out.logprobs.data<float>() : nullptr;
  a.actual_logprobs = out.actual_logprobs.data<float>();
  a.actual_ranks = want_ranks ? out.actual_ranks.data<int32_t>() : nullptr;
  a.error_flag = flags.as<unsigned>();
  cuda::topk_lm_head_cuda(a, workspace.get(), stream);
  unsigned host_flags[3];
  OPD_CUDA_CHECK(cudaMemcpyAsync(host_flags, flags.get(), sizeof(host_flags),
                                 cudaMemcpyDeviceToHost, stream));
  OPD_CUDA_CHECK(cudaStreamSynchronize(stream));
  if (host_flags[0] != 0xffffffffu) {
    const int64_t r = host_flags[0];
    const int32_t id = cuda::topk_lm_head_cuda_bad_id(workspace.get(), N, V, k, vocab_tile,
                                                      row_chunk, r, stream);
    OPD_FAIL(Internal, "teacher scoring: row ", r, ": logit of id ", id,
             " is not finite (the teacher model produced NaN/inf)");
  }
  OPD_CHECK(host_flags[1] == 0xffffffffu, Internal, "topk_lm_head on CUDA: row ", host_flags[1],
            ": actual id changed after validation");
  OPD_CHECK(host_flags[2] == 0xffffffffu, Internal, "topk_lm_head on CUDA: row ", host_flags[2],
            ": a top-K merge slot was out of bounds (kernel invariant broken; results discarded)");
  return out;
#endif
}

TopKLmHeadResult topk_lm_head(const TopKLmHeadArgs& a) {
  if (a.hidden.defined() && a.hidden.device() == Device::CUDA) {
    OPD_CHECK(!a.sample, Unsupported, "topk_lm_head on CUDA: sampling is CPU-only");
    const int64_t N = a.hidden.dim(0);
    OPD_CHECK(a.actual.empty() || static_cast<int64_t>(a.actual.size()) == N, InvalidArgument,
              "topk_lm_head: ", a.actual.size(), " actual ids for ", N, " rows");
    Tensor actual;
    if (!a.actual.empty()) actual = Tensor::from_vector(a.actual, {N});
    const bool ranks = a.want_ranks && !a.actual.empty();
    TopKLmHeadDeviceResult d = topk_lm_head_device(a.hidden, a.lm_head, actual, a.k,
                                                   a.temperature, ranks, a.vocab_tile,
                                                   a.row_chunk);
    TopKLmHeadResult out;
    auto copy = [](const Tensor& t, auto& vec) {
      using E = typename std::decay_t<decltype(vec)>::value_type;
      Tensor h = t.to(Device::CPU);
      const E* p = h.data<E>();
      vec.assign(p, p + h.numel());
    };
    copy(d.ids, out.ids);
    copy(d.logprobs, out.logprobs);
    copy(d.actual_logprobs, out.actual_logprobs);
    if (ranks) {
      std::vector<int32_t> r;
      copy(d.actual_ranks, r);
      out.actual_ranks.assign(r.begin(), r.end());
    }
    return out;
  }
  OPD_CHECK(a.hidden.dtype() == DType::F32 && a.lm_head.dtype() == DType::F32 &&
                a.hidden.ndim() == 2 && a.lm_head.ndim() == 2 &&
                a.hidden.dim(1) == a.lm_head.dim(1),
            InvalidArgument, "topk_lm_head: hidden ", a.hidden.describe(), " and lm_head ",
            a.lm_head.describe(), " must be f32 [N, H] and [V, H]");
  const int64_t N = a.hidden.dim(0), V = a.lm_head.dim(0), K = a.k;
  OPD_CHECK(K >= 0 && K <= V, InvalidArgument, "topk_lm_head: k = ", K, " is outside [0, ", V, "]");
  OPD_CHECK(std::isfinite(a.temperature) && a.temperature > 0, InvalidArgument,
            "topk_lm_head: temperature ", a.temperature, " must be finite and > 0");
  OPD_CHECK(a.vocab_tile > 0 && a.row_chunk > 0, InvalidArgument, "topk_lm_head: vocab_tile ",
            a.vocab_tile, " and row_chunk ", a.row_chunk, " must be > 0");
  OPD_CHECK(a.actual.empty() || static_cast<int64_t>(a.actual.size()) == N, InvalidArgument,
            "topk_lm_head: ", a.actual.size(), " actual ids for ", N, " rows");
  for (int64_t r = 0; r < static_cast<int64_t>(a.actual.size()); ++r) {
    const int32_t y = a.actual[r];
    OPD_CHECK(y == -1 || (y >= 0 && y < V), InvalidData, "topk_lm_head: row ", r,
              ": actual token id ", y, " is outside the vocabulary [0, ", V, ")");
  }
  if (a.sample) {
    OPD_CHECK(std::isfinite(a.sample_temperature) && a.sample_temperature >= 0, InvalidArgument,
              "topk_lm_head: sample temperature ", a.sample_temperature, " must be finite, >= 0");
    OPD_CHECK(static_cast<int64_t>(a.streams.size()) == N, InvalidArgument, "topk_lm_head: ",
              a.streams.size(), " sampling streams for ", N, " rows");
  }

  TopKLmHeadResult out;
  out.ids.assign(static_cast<size_t>(N * K), -1);
  out.logprobs.assign(static_cast<size_t>(N * K), std::numeric_limits<float>::quiet_NaN());
  out.actual_logprobs.assign(static_cast<size_t>(N), std::numeric_limits<float>::quiet_NaN());
  if (a.sample) {
    out.sampled.assign(static_cast<size_t>(N), -1);
    out.sampled_logprobs.assign(static_cast<size_t>(N), std::numeric_limits<float>::quiet_NaN());
  }
  if (N == 0) return out;

  const int64_t tile = std::min(a.vocab_tile, V), chunk = std::min(a.row_chunk, N);
  const double inv_t = 1.0 / a.temperature;
  const double inv_ts = a.sample && a.sample_temperature > 0 ? 1.0 / a.sample_temperature : 0.0;
  Tensor buf = Tensor::empty({chunk * tile}, DType::F32);
  std::vector<RowState> state(static_cast<size_t>(N));
  std::vector<Entry> heaps(static_cast<size_t>(N * K));  // row r: [r*K, r*K + size_r)
  std::vector<int32_t> heap_size(static_cast<size_t>(N), 0);
  const Tensor none;

  for (int64_t r0 = 0; r0 < N; r0 += chunk) {
    const int64_t rn = std::min(chunk, N - r0);
    const Tensor h = a.hidden.slice_rows(r0, r0 + rn);
    for (int64_t v0 = 0; v0 < V; v0 += tile) {
      const int64_t vn = std::min(tile, V - v0);
      Tensor z = buf.slice_rows(0, rn * vn).reshape({rn, vn});
      ops::linear_forward(h, a.lm_head.slice_rows(v0, v0 + vn), none, z);
      const float* zp = z.data<float>();
      parallel_for(rn, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) {
          const int64_t r = r0 + i;
          const float* row = zp + i * vn;
          RowState& st = state[static_cast<size_t>(r)];
          // Online LSE of z / T over this tile.
          double tmax = -std::numeric_limits<double>::infinity();
          for (int64_t j = 0; j < vn; ++j) {
            if (!std::isfinite(row[j])) {
              if (st.bad_id < 0) st.bad_id = static_cast<int32_t>(v0 + j);
              continue;
            }
            tmax = std::max(tmax, row[j] * inv_t);
          }
          if (tmax > -std::numeric_limits<double>::infinity()) {
            const double m_new = std::max(st.m, tmax);
            double sum = 0;
            for (int64_t j = 0; j < vn; ++j)
              if (std::isfinite(row[j])) sum += std::exp(row[j] * inv_t - m_new);
            st.s = st.s * std::exp(st.m - m_new) + sum;
            st.m = m_new;
          }
          // Running top-K: heap root = worst kept entry.
          if (K > 0) {
            Entry* heap = heaps.data() + r * K;
            int32_t& size = heap_size[static_cast<size_t>(r)];
            for (int64_t j = 0; j < vn; ++j) {
              const Entry c{row[j], static_cast<int32_t>(v0 + j)};
              if (!std::isfinite(c.z)) continue;
              if (size < K) {
                heap[size++] = c;
                std::push_heap(heap, heap + size, better);
              } else if (better(c, heap[0])) {
                std::pop_heap(heap, heap + size, better);
                heap[size - 1] = c;
                std::push_heap(heap, heap + size, better);
              }
            }
          }
          if (!a.actual.empty()) {
            const int32_t y = a.actual[static_cast<size_t>(r)];
            if (y >= v0 && y < v0 + vn) st.z_actual = row[y - v0];
          }
          if (a.sample) {
            const uint64_t stream = a.streams[static_cast<size_t>(r)];
            for (int64_t j = 0; j < vn; ++j) {
              if (!std::isfinite(row[j])) continue;
              const int64_t id = v0 + j;
              double key;
              if (inv_ts > 0) {
                const double u = philox_uniform(a.seed, stream, static_cast<uint64_t>(id));
                if (u <= 0) continue;  // Gumbel noise -inf: never the argmax
                key = row[j] * inv_ts - std::log(-std::log(u));
              } else {
                key = row[j];
              }
              if (key > st.best_sample) {  // strict: ties keep the smaller id
                st.best_sample = key;
                st.sampled = static_cast<int32_t>(id);
                st.z_sampled = row[j];
              }
            }
          }
        }
      });
    }
  }

  if (a.want_ranks && !a.actual.empty()) {
    // Second pass: count the ids whose logit beats the actual token's (same GEMM tiles, so the
    // comparison sees exactly the values the first pass saw).
    out.actual_ranks.assign(static_cast<size_t>(N), 0);
    for (int64_t r0 = 0; r0 < N; r0 += chunk) {
      const int64_t rn = std::min(chunk, N - r0);
      const Tensor h = a.hidden.slice_rows(r0, r0 + rn);
      for (int64_t v0 = 0; v0 < V; v0 += tile) {
        const int64_t vn = std::min(tile, V - v0);
        Tensor z = buf.slice_rows(0, rn * vn).reshape({rn, vn});
        ops::linear_forward(h, a.lm_head.slice_rows(v0, v0 + vn), none, z);
        const float* zp = z.data<float>();
        for (int64_t i = 0; i < rn; ++i) {
          const int64_t r = r0 + i;
          if (a.actual[static_cast<size_t>(r)] < 0) continue;
          const float zy = state[static_cast<size_t>(r)].z_actual;
          int64_t c = 0;
          for (int64_t j = 0; j < vn; ++j) c += zp[i * vn + j] > zy;
          out.actual_ranks[static_cast<size_t>(r)] += c;
        }
      }
    }
    for (int64_t r = 0; r < N; ++r)
      if (a.actual[static_cast<size_t>(r)] >= 0) out.actual_ranks[static_cast<size_t>(r)] += 1;
  }

  for (int64_t r = 0; r < N; ++r) {
    const RowState& st = state[static_cast<size_t>(r)];
    OPD_CHECK(st.bad_id < 0, Internal, "teacher scoring: row ", r, ": logit of id ", st.bad_id,
              " is not finite (the teacher model produced NaN/inf)");
    const double lse = st.m + std::log(st.s);
    if (K > 0) {
      Entry* heap = heaps.data() + r * K;
      std::sort_heap(heap, heap + K, better);  // ascending under `better`: best first
      for (int64_t j = 0; j < K; ++j) {
        out.ids[r * K + j] = heap[j].id;
        out.logprobs[r * K + j] = static_cast<float>(heap[j].z * inv_t - lse);
      }
    }
    if (!a.actual.empty() && a.actual[static_cast<size_t>(r)] >= 0)
      out.actual_logprobs[r] = static_cast<float>(st.z_actual * inv_t - lse);
    if (a.sample) {
      out.sampled[r] = st.sampled;
      out.sampled_logprobs[r] = static_cast<float>(st.z_sampled * inv_t - lse);
    }
  }
  return out;
}

}  // namespace opd
